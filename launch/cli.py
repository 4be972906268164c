"""One-line command-line errors for the entry points (train, sft, sweep, eval, aot, report).

absl prints a traceback for a bad ``--config.<field>`` (ml_collections parses the overrides while the
config flag is defined, at import) and help text before a ``UsageError``; a researcher needs one line
naming the flag and, for a misspelt field, the field meant. ``define_config_file`` and ``run`` give it:

    _CONFIG = cli.define_config_file("config", default, "Run config file.")
    ...
    if __name__ == "__main__":
        cli.run(main)

Every error is printed as ``error: <message>`` on one line of stderr and the process exits with 2;
Ctrl-C prints one line (``interrupt_hint``) and exits with 130.
"""

from __future__ import annotations

import difflib
import os
import re
import runpy
import sys
from collections.abc import Callable

from absl import app, flags
from ml_collections import config_flags

USAGE_EXIT = 2
INTERRUPT_EXIT = 130
_CONFIG_FLAGS: list[str] = []  # names of the flags defined through define_config_file


def one_line(text: str) -> str:
    """``text`` with its lines joined by "; " (quotes and blank lines dropped)."""
    text = str(text)
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":  # an exception's repr'd message
        text = text[1:-1]
    parts = [p.strip() for p in text.replace("\\n", "\n").splitlines()]
    return "; ".join(p for p in parts if p)


def fail(message: str, code: int = USAGE_EXIT) -> None:
    """Print ``error: <message>`` as one line on stderr and exit with ``code``."""
    head, tb, rest = str(message).partition("Traceback (most recent call last):")
    if tb:  # a parser that quotes a traceback: its head and the exception line
        message = f"{head.strip().rstrip(':')}: {rest.strip().splitlines()[-1]}"
    line = one_line(message)
    sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()
    exit_ = SystemExit(code)
    exit_.printed = line  # said already; distributed.failures_shared passes it to the other hosts
    raise exit_


def _overrides(name: str, argv: list[str]) -> list[str]:
    """The ``--<name>.<field>=<value>`` arguments of ``argv`` (fields dotted)."""
    out = []
    for a in argv[1:]:
        m = re.match(rf"--{re.escape(name)}\.([\w.]+)(=.*)?$", a)
        if m:
            out.append(m.group(1))
    return out


def _config_file(name: str, argv: list[str], default: str | None) -> str | None:
    for i, a in enumerate(argv[1:], 1):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return default


def unknown_field_message(config, name: str, fields: list[str]) -> str | None:
    """``"--config.<field>: no such field ..."`` for the first override naming no field of ``config``
    (with the closest existing names), or None when every override names a field."""
    for dotted in fields:
        node, walked = config, []
        for part in dotted.split("."):
            children = list(node.keys()) if hasattr(node, "keys") else []
            if part not in children:
                where = ".".join([name, *walked])
                near = difflib.get_close_matches(part, children, n=3, cutoff=0.5)
                hint = f"; did you mean {' or '.join(f'--{where}.{c}' for c in near)}?" if near else ""
                known = "" if near else f"; {where} has {', '.join(sorted(children)) or 'no fields'}"
                return f"--{name}.{dotted}: {where} has no field {part!r}{hint}{known}"
            node = node[part]
            walked.append(part)
    return None


def load_config(path: str):
    """The ConfigDict of a config file ``path[:arg]`` (its ``get_config``)."""
    file, _, arg = path.partition(":")
    get = runpy.run_path(file)["get_config"]
    return get(arg) if arg else get()


_HELP_FLAGS = {"--help", "-h", "-?", "--helpshort", "--helpfull"}


def field_list(path: str, name: str = "config") -> str:
    """The fields of config file ``path`` for ``--help``: ``"Fields (--<name>.<field>=<value>): a.b=1, ..."``
    (one sentence), or a note naming the file when it does not load."""
    from bipace_jax.resume import flatten

    try:
        fields = flatten(load_config(path).to_dict())
    except Exception as e:  # help still prints; the run itself reports the error in one line
        return f"(the fields of {path} are not listed: it does not load: {one_line(e)})"
    shown = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    return f"Fields of {path} (override as --{name}.<field>=<value>): {shown}."


def help_lists_fields(name: str, default: str | None, argv: list[str] | None = None) -> None:
    """On ``--help`` (any of absl's help flags in ``argv``), append ``field_list`` of the config file
    that ``--<name>`` names (else ``default``) to ``__main__``'s docstring, which absl prints."""
    argv = sys.argv if argv is None else argv
    path = _config_file(name, argv, default)
    if path is not None and _HELP_FLAGS & set(argv[1:]):
        main = sys.modules.get("__main__")
        if main is not None:
            main.__doc__ = f"{main.__doc__ or ''}\n{field_list(path, name)}\n"


def define_config_file(name: str, default: str | None, help_string: str, argv: list[str] | None = None):
    """``config_flags.DEFINE_config_file`` whose failures are one line (``fail``) instead of a traceback:
    an unknown ``--<name>.<field>`` names the field and the closest existing ones; a config file that
    does not exist or does not load names the file. Returns the flag holder.
    """
    argv = sys.argv if argv is None else argv
    path = _config_file(name, argv, default)
    help_lists_fields(name, default, argv)
    try:
        holder = config_flags.DEFINE_config_file(name, default, help_string)
    except Exception as e:  # ml_collections raises AttributeError/KeyError/ValueError from inside absl
        msg = None
        if path is not None:
            try:
                msg = unknown_field_message(load_config(path), name, _overrides(name, argv))
            except Exception:
                msg = None
        fail(msg or f"--{name}: {e}")
    _CONFIG_FLAGS.append(name)
    return holder


_CONFIG_DICTS: dict = {}  # name -> the ConfigDict of each flag defined through define_config_dict


def define_config_dict(name: str, config, help_string: str):
    """``config_flags.DEFINE_config_dict`` whose bad overrides are one line (``fail``): an unknown
    ``--<name>.<field>`` names the field and the closest existing ones. Returns the flag holder."""
    try:  # ml_collections parses the overrides here, at definition (see define_config_file)
        holder = config_flags.DEFINE_config_dict(name, config, help_string)
    except Exception as e:
        fail(unknown_field_message(config, name, _overrides(name, sys.argv)) or f"--{name}: {one_line(e)}")
    _CONFIG_DICTS[name] = config
    return holder


def _parse(argv: list[str]) -> list[str]:
    """absl parsing; a flag error or a config file that does not load -> one line."""
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e))
    except Exception as e:  # ml_collections raises AttributeError/KeyError for a field a config dict lacks
        for name, config in _CONFIG_DICTS.items():
            if msg := unknown_field_message(config, name, _overrides(name, argv)):
                fail(msg)
        fail(str(e))
    for name in _CONFIG_FLAGS:
        path = _config_file(name, argv, flags.FLAGS[name].default_as_str.strip("'"))
        if path and not os.path.isfile(path.partition(":")[0]):
            fail(f"--{name}={path}: no such config file (expected a configs/*.py file)")
        try:
            flags.FLAGS[name].value.keys()  # a config file that failed to load raises here
        except Exception as e:
            first = str(e).split("\n")
            why = next((ln.strip() for ln in first if "Errno" in ln or "Error" in ln.split(":")[0]), first[0])
            fail(f"--{name}={path}: the config file does not load ({why})" if path else f"--{name}: {why}")
    return rest


def interrupted_line(done: int, total: int, checkpoint: int | None) -> str:
    """The one line of a Ctrl-C during training: ``done`` of ``total`` iterations completed, the latest
    checkpoint's iteration (None: none yet) that the same command resumes from."""
    if not checkpoint:
        return (
            f"stopped by Ctrl-C at iteration {done} of {total}, before the first checkpoint; "
            "the same command starts the run again from iteration 0"
        )
    return (
        f"stopped by Ctrl-C at iteration {done} of {total}; the same command resumes from the "
        f"checkpoint of iteration {checkpoint}"
    )


def interrupt_hint() -> str:
    """The line printed on Ctrl-C when the command gives none (``KeyboardInterrupt("<line>")`` gives one)."""
    return "stopped by Ctrl-C; run the same command again to resume from the last checkpoint"


def _stop(line: str, hard_exit: bool) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if hard_exit:  # interpreter teardown after interrupted XLA work can segfault (rc -11 instead of 130)
        from bipace_jax import runfolder

        runfolder.drop_local_folders()  # os._exit skips atexit: a gs:// model's local copy would stay in $TMPDIR
        os._exit(INTERRUPT_EXIT)
    raise SystemExit(INTERRUPT_EXIT)


def run(
    main: Callable[[list[str]], object], interrupt: str | None = None, flags_parser=None, hard_exit: bool = False
) -> None:
    """``absl.app.run(main)`` with one-line errors: flag errors, ``app.UsageError`` (no help text),
    and Ctrl-C: one line (a ``KeyboardInterrupt``'s message, else ``interrupt``, else
    ``interrupt_hint()``) and exit status 130. ``hard_exit``: on Ctrl-C leave with ``os._exit`` (no
    atexit handlers): for commands whose ``main`` closes its own files, pools and checkpointers first.
    """

    def wrapped(argv):
        line = None
        try:
            return main(argv)
        except app.UsageError as e:
            fail(str(e))
        except KeyboardInterrupt as e:
            line = str(e) or interrupt or interrupt_hint()
        if line is not None:
            _stop(line, hard_exit)

    def parser(argv):
        if flags_parser is None:
            return _parse(argv)
        try:
            return flags_parser(argv)
        except flags.Error as e:
            fail(str(e))

    line = None
    try:
        app.run(wrapped, flags_parser=parser)
    except KeyboardInterrupt as e:  # during start-up, before main
        line = str(e) or interrupt or interrupt_hint()
    if line is not None:
        _stop(line, False)
