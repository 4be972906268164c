r"""Warm start by behaviour cloning and DAgger on TextCraft's oracle (`bipace_jax.sft.run`).

    python -m launch.sft --config=configs/sft_textcraft_tiny.py --workdir=runs/sft \
        --out=runs/warm_start  # a new folder: never over the shipped bipace_jax/data/textcraft_tiny

Running the same command again resumes from the last finished round; with a config that changes the
run (``bipace_jax.resume.SFT_NEUTRAL`` lists what may change) it is refused, naming the fields, unless
``--allow_config_change``. While it runs, a second warm start in the same ``--workdir`` refuses
(``runfolder.RunLock``). See docs/warm_start.md.
"""

from __future__ import annotations

from absl import flags

from launch import cli

cli.define_config_file("config", "configs/sft_textcraft_tiny.py", "SFT config file")
flags.DEFINE_string("workdir", "runs/sft", "run folder (checkpoints, metrics, report)")
flags.DEFINE_string("out", "", "HF checkpoint folder to write at the end ('' = none)")
flags.DEFINE_bool("progress", True, "tqdm progress bars")
flags.DEFINE_bool(
    "allow_config_change",
    False,
    "Resume although the config differs from the run folder's config.json in fields that change the run "
    "(the old config is kept as config.before_<updates>.json).",
)


def main(argv):
    del argv
    from bipace_jax import config as config_lib
    from bipace_jax import resume, runfolder
    from bipace_jax.sft import run

    f = flags.FLAGS
    lock = runfolder.RunLock(f.workdir, "sft", "launch.sft")
    try:
        runfolder.prepare(f.workdir)
        lock.acquire()  # one warm start per folder: a second one refuses before it writes anything
        report = run(f.config, f.workdir, f.out or None, progress=f.progress, allow_config_change=f.allow_config_change)
    except (config_lib.ConfigError, runfolder.RunFolderError, resume.ConfigChangeError) as e:
        cli.fail(str(e))
    finally:
        lock.release()
    v, nan = report["final_val"], float("nan")
    print(
        f"validation success: seen goals {v.get('val/success_rate', nan):.3f}, held-out goals "
        f"{v.get('val/holdout/success_rate', nan):.3f}; wall {report['wall_time_s']:.0f}s"
    )


if __name__ == "__main__":
    cli.run(main, interrupt="stopped by Ctrl-C; run the same command again to resume from the last finished round")
