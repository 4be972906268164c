"""Score a checkpoint on a config's validation panels (seen and held-out), with no training state.

    python -m launch.eval --checkpoint=runs/textcraft_tiny/hf_final --config=configs/textcraft_tiny.py
    python -m launch.eval --config=configs/textcraft_tiny.py   # the config's model.checkpoint (the warm start)

Plays exactly the games of the trainer's validation (``bipace_jax.validation``: same panels, same
sampler keys, same means), so the numbers equal what a run of that config logs for the same policy.
No optimizer, no reference copy and no orbax checkpoint are made. ``--out`` (default
``runs/eval/<checkpoint folder>~<8 hex of its path>``; a folder of another run or command is refused) receives ``eval.json`` (the record, the checkpoint, the panels),
``report.md`` (a markdown table, the 95% Wilson interval of each panel), ``config.json`` and, unless
``--notranscripts``, the panels' episode transcripts ``episodes/0.jsonl`` (``log.transcripts_max_games``
games per panel; ``python -m launch.transcripts --run=<out>`` renders them). One process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time

from absl import flags, logging

from launch import cli
from launch._common import ROOT

_CONFIG = cli.define_config_file("config", os.path.join(ROOT, "configs", "textcraft_tiny.py"), "Run config file.")
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint",
    "",
    "Hugging Face folder to score, local or gs:// (a run's hf_final/); '' = the config's model.checkpoint.",
)
_OUT = flags.DEFINE_string("out", "", "Result folder, local or gs:// ('' = runs/eval/<checkpoint folder name>).")
_TRANSCRIPTS = flags.DEFINE_bool("transcripts", True, "Write the panels' transcripts (episodes/0.jsonl).")


def default_out(checkpoint: str) -> str:
    """``runs/eval/<name>~<8 hex>``: the checkpoint folder's name (with its parent's for a run's
    ``hf_final``) and 8 hex digits of the SHA-1 of its absolute path or URL, so two checkpoints never
    share a default folder (``a/run/hf_final`` and ``b/run/hf_final``)."""
    parts = os.path.normpath(checkpoint.rstrip("/")).split(os.sep)
    name = "_".join(parts[-2:]) if parts[-1] == "hf_final" and len(parts) > 1 else parts[-1]
    return os.path.join("runs", "eval", f"{name}~{hashlib.sha1(_where(checkpoint).encode()).hexdigest()[:8]}")


def _where(checkpoint: str) -> str:
    """A checkpoint's identity: its absolute local path, or its URL, without a trailing slash."""
    return checkpoint.rstrip("/") if "://" in checkpoint else os.path.abspath(checkpoint).rstrip("/")


#: The files ``evaluate`` writes (a folder holding only these is an earlier evaluation's, see ``claim_output``).
OUT_FILES = ("eval.json", "report.md", "config.json", "episodes")


def _ci(rate, games: int) -> str:
    from bipace_jax.stats import wilson

    if rate is None or rate != rate or games <= 0:
        return "-"
    low, high = wilson(rate * games, games)
    return f"{100 * low:.1f}-{100 * high:.1f}%"


def report_markdown(result: dict) -> str:
    """The markdown report of an ``evaluate`` result: one row per success rate (panel, then categories),
    with games and the panel's 95% Wilson interval."""
    from bipace_jax import metric_keys as keys
    from bipace_jax.stats import panel_games

    rec, g = result["record"], result["val_group_size"]
    rows = sorted((k for k in rec if "success_rate" in k), key=lambda k: (k.count("/"), k))
    lines = [
        f"# Evaluation of `{result['checkpoint']}`",
        "",
        f"Config `{result['config_file']}`, seed {result['seed']}, temperature {result['temperature']}, "
        f"{result['wall_s']:.1f} s.",
        "",
        "| panel | success | games | 95% interval |",
        "|---|---|---|---|",
    ]
    for k in rows:
        prefix, _, cat = k.partition("/success_rate")
        n = panel_games(rec, prefix, g, cat.lstrip("/") or None)
        rate = rec[k]
        shown = "-" if rate != rate else f"{100 * rate:.1f}%"
        lines.append(f"| {k} | {shown} | {n} | {_ci(rate, n) if not cat else ''} |")
    lines.append("")
    lines.append(f"Validation seconds: {rec.get(keys.VALIDATION_SECONDS, 0.0):.1f}")
    return "\n".join(lines) + "\n"


def _policy(spec):
    """(actor, validation engine, tokenizer) of the checkpoint on this host's sampling mesh, the
    parameters loaded in the compute dtype (the trainer samples with that cast of its master copy)."""
    import jax

    from bipace_jax import build, distributed, plan, sharding
    from bipace_jax.sampling import Engine

    layout = plan.HostLayout.of(spec, 1, jax.device_count(), jax.local_device_count())
    mesh = sharding.make_mesh(*layout.mesh_shape)
    local = distributed.local_mesh(mesh, layout.sampler_tensor)
    tokenizer = build.load_model_tokenizer(spec.model)
    model = dataclasses.replace(spec.model, param_dtype=spec.model.dtype)
    actor = build.build_actor(model, tokenizer, local, seed=spec.seed)
    eos = build.stop_token_ids(actor.config.eos_token_ids, tokenizer, spec.model.checkpoint) or None
    engine = Engine(tokenizer, dataclasses.replace(spec.val_sampler, eos_token_ids=eos), mesh=local)
    return actor, engine, tokenizer


def evaluate(config, config_file: str, out: str, write_transcripts: bool = True) -> dict:
    """Play ``config``'s validation panels with its ``model.checkpoint``; write ``out``'s files.

    Returns the result written to ``eval.json``: ``record`` (``val/...`` metrics as the trainer logs
    them), ``checkpoint``, ``config_file``, ``seed``, ``temperature``, ``val_group_size``, ``panels``
    (name -> ``[task_id, game_seed]`` pairs), ``wall_s``, ``files``.

    Raises:
      ConfigError: a bad config field, or no panel game (``val.num_tasks`` and ``num_holdout_tasks`` 0).
      RunFolderError: ``out`` cannot be written.
    """
    t0 = time.perf_counter()
    from bipace_jax import build, runfolder, transcripts, validation
    from bipace_jax import config as config_lib

    spec = build.build_spec(config)
    if not spec.model.checkpoint:
        raise config_lib.ConfigError(
            "--checkpoint: expected a Hugging Face folder (config.json), or a config whose model.checkpoint is one; got ''"
        )
    import jax

    spec.mesh.check_devices(jax.device_count())
    panels = validation.select(spec, spec.env.name)
    if not any(panels.games.values()):
        raise config_lib.ConfigError("config.val.num_tasks: the config selects no panel game (and num_holdout_tasks)")
    # never over another run's or command's files; one folder per checkpoint and config file
    runfolder.claim_output(out, "--out", "launch.eval", f"{_where(spec.model.checkpoint)} ({config_file})", OUT_FILES)
    actor, engine, tokenizer = _policy(spec)
    pool, pools = validation.start_pools(spec, spec.env.name, panels, 1, validating=True)
    try:
        rec, results = validation.validate(actor, engine, pools, spec, panels, progress=spec.log.progress)
    finally:
        for p in {id(p): p for p in (pool, *pools.values())}.values():
            p.close()
    root, files = runfolder.path(out), ["eval.json", "report.md", "config.json"]
    if write_transcripts:
        for name, res in results.items():
            kw = dict(iteration=0, phase=name, gamma=spec.estimator.gamma, max_games=spec.log.transcripts_max_games)
            rows = transcripts.step_rows(res, tokenizer, **kw) if res is not None else []
            transcripts.write(out, 0, name, transcripts.gather(rows, spec.log.transcripts_max_games))
        files.append(f"{transcripts.EPISODES}/0.jsonl")
    result = {
        "checkpoint": spec.model.checkpoint,
        "config_file": config_file,
        "seed": spec.seed,
        "temperature": spec.val.temperature,
        "val_group_size": spec.val.group_size,
        "record": rec,
        "panels": {k: [list(g) for g in v] for k, v in panels.games.items()},
        "wall_s": time.perf_counter() - t0,
        "files": files,
    }
    runfolder.write_text(root / "config.json", spec.config.to_json_best_effort(indent=2))
    runfolder.write_text(root / "eval.json", json.dumps(result, indent=2, default=float))
    runfolder.write_text(root / "report.md", report_markdown(result))
    return result


def main(argv):
    del argv
    from bipace_jax import config as config_lib
    from bipace_jax import runfolder

    if not flags.FLAGS["verbosity"].present:  # orbax/absl INFO lines drown the progress bars
        logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    if _CHECKPOINT.value:
        config.model.checkpoint = _CHECKPOINT.value
    checkpoint = config.model.checkpoint
    out = _OUT.value or default_out(checkpoint or "none")
    config_file = flags.FLAGS["config"].default_as_str.strip("'")
    config_file = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--config=")), config_file)
    try:
        result = evaluate(config, config_file, out, _TRANSCRIPTS.value)
    except (config_lib.ConfigError, runfolder.RunFolderError) as e:
        cli.fail(str(e))
    print(report_markdown(result) + f"\nwrote {', '.join(result['files'])} in {out}", flush=True)


if __name__ == "__main__":
    cli.run(main)
