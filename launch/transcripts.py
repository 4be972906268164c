"""Print a run's episode transcripts (``episodes/<i>.jsonl``, ``bipace_jax.transcripts``) as readable games.

    python -m launch.transcripts --run=runs/textcraft_tiny                       # the last iteration's games
    python -m launch.transcripts --run=runs/textcraft_tiny --iteration=0 --game=3 --phase=rollout

Each game: a header (phase, task, seed, outcome, return), the turn-0 prompt, then per turn the
observation, response, action, reward, discounted return, advantage and step group (PACE kind), and
for a row played by an older policy (asynchronous RL, ``config.async_rl.max_staleness`` > 0) "sampled by
version v (lag l)": l = the iteration minus v. Works on a ``launch.eval`` folder too (its transcripts are iteration 0).
"""

from __future__ import annotations

from absl import flags

from launch import cli

_RUN = flags.DEFINE_string("run", None, "Run folder (or launch.eval --out folder), local or gs://.", required=True)
_ITERATION = flags.DEFINE_integer("iteration", None, "Transcript file episodes/<iteration>.jsonl (default: the last).")
_GAME = flags.DEFINE_integer("game", None, "Only this game number (the 'game' field; default: every game).")
_PHASE = flags.DEFINE_string("phase", None, "Only this phase: rollout, val or val/holdout (default: every phase).")


def show(run: str, iteration: int | None = None, game: int | None = None, phase: str | None = None) -> str:
    """The rendered text of ``run``'s transcripts (``transcripts.render``).

    Raises:
      ValueError: the run has no transcripts, no file for ``iteration``, or no row for ``game``/``phase``
        (the message lists what there is).
    """
    from bipace_jax import runfolder, transcripts

    runfolder.path(run, "--run")
    have = transcripts.iterations(run)
    if not have:
        raise ValueError(
            f"--run={run}: no episodes/<iteration>.jsonl (train with --config.log.transcripts_every=k, or run launch.eval)"
        )
    iteration = have[-1] if iteration is None else iteration
    if iteration not in have:
        raise ValueError(f"--iteration={iteration}: {run} has transcripts of iterations {have}")
    rows = transcripts.read(run, iteration)
    text = transcripts.render(rows, game=game, phase=phase)
    if not text:
        games = sorted({(r["phase"], r["game"]) for r in rows})
        raise ValueError(f"--game={game} --phase={phase}: iteration {iteration} has (phase, game) {games}")
    return text


def main(argv):
    del argv
    from bipace_jax import runfolder

    try:
        print(show(_RUN.value, _ITERATION.value, _GAME.value, _PHASE.value), flush=True)
    except (ValueError, runfolder.RunFolderError) as e:
        cli.fail(str(e))


if __name__ == "__main__":
    cli.run(main)
