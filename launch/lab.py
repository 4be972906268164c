"""The credit-assignment lab: every registered estimator against exact advantages (`docs/lab.md`).

    python -m launch.lab                                   # the documented grid -> docs/results/lab/
    python -m launch.lab --config.mode=cell --config.view.paraphrases=8 --config.view.sigma=0.2
    python -m launch.lab --config.out=/tmp/lab --config.batch.seeds=50 --config.grid.paraphrases=1,8

Every field of `bipace_jax/lab/config.py` can be overridden with `--config.<field>=<value>`. The
grid mode writes `report.json`, `report.md` (tables, the paired BiPACE-vs-GiGPO differences, the
branching and staleness arms, the TextCraft anchor, the command, wall time and machine load) and PNG
plots; the cell mode prints one
table of scores and final success rates and writes JSON (default `benchmarks/lab.json`).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time

import numpy as np

import bipace_jax.lab as lab
from bipace_jax import runfolder
from bipace_jax.config import ConfigError
from bipace_jax.lab import config as lab_config
from bipace_jax.lab.scores import interval as lab_interval
from launch import cli
from launch._common import ROOT, write_json

_CONFIG = cli.define_config_dict("config", lab_config.default_config(), "Lab config (bipace_jax/lab/config.py).")

SHOWN = (
    "corr",
    "sign",
    "nmse",
    "step_corr",
    "step_nmse",
    "step_state_err",
    "step_action_err",
    "no_signal",
    "singleton_group_rate",
)
PAIRED = ("corr", "step_corr", "step_nmse")


def _fmt(iv) -> str:
    m, hw, _ = iv
    return f"{m:.3f} +- {hw:.3f}"


def _cell_scores(c, lab, m, sigma, fm, index, game, cfgs, branch=((), 1), max_lag=0, drift=0.0):
    """Per-seed scores of every estimator on one batch of the scored policy (rng per cell).

    `branch` (turns, children): tree-shaped games; `max_lag` k > 0: each game draws a version lag in
    0..k and its fingerprints drift by `drift` per version (the policy is the same: drift only)."""
    view = lab_config.view(c, paraphrases=m, sigma=sigma, false_merge=fm, drift=drift)
    rng = np.random.default_rng([c.seed, index])
    pi = lab.bonus_policy(game, c.score_bonus, c.batch.seeds)
    lag = None
    if max_lag > 0:
        lag = rng.integers(0, max_lag + 1, (c.batch.seeds, c.batch.groups, c.batch.group_size))
    ro = lab.sample_rollouts(
        game,
        pi if lag is None else np.broadcast_to(pi, (max_lag + 1,) + pi.shape),  # every version plays pi
        rng,
        groups=c.batch.groups,
        group_size=c.batch.group_size,
        horizon=c.game.horizon,
        paraphrases=m,
        history=view.history,
        branch_turns=branch[0],
        branch_children=branch[1],
        lag=lag,
    )
    batch = lab.build_batch(game, ro, pi, view, rng, gamma=c.estimator.gamma, render_text=c.render_text)
    scores, diags = lab.score_estimators(batch, cfgs, delta=c.delta)
    return batch, scores, diags


def _summary(scores: dict) -> dict:
    return {name: {k: lab_interval(v) for k, v in s.items()} for name, s in scores.items()}


def _paired(scores: dict, a: str, b: str):
    """Per-seed differences a - b (same batch) of the `PAIRED` scores, as intervals."""
    if a not in scores or b not in scores:
        return None
    return {k: lab_interval(scores[a][k] - scores[b][k]) for k in PAIRED}


def _plots(out: str, rep: dict, names: list, scatter) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []

    def save(fig, name):
        p = os.path.join(out, name)
        fig.tight_layout()
        fig.savefig(p, dpi=90)
        plt.close(fig)
        files.append(name)

    for part, xkey, xlabel, logx in (
        ("m_sweep", "m", "paraphrases m", True),
        ("sigma_sweep", "sigma", "fingerprint noise sigma", False),
    ):
        rows = rep[part]
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        for ax, key, title in zip(
            axes,
            ("corr", "step_nmse", "singleton_group_rate"),
            ("corr(A-hat, A*)", "step term: normalised MSE vs A*", "singleton step-group rate"),
        ):
            for n in names:
                xs = [r[xkey] for r in rows]
                ys = np.array([r["summary"][n][key][0] for r in rows])
                hw = np.array([r["summary"][n][key][1] for r in rows])
                ax.errorbar(xs, ys, yerr=hw, marker="o", ms=3, capsize=2, label=n)
            if logx:
                ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_title(title)
            if key == "singleton_group_rate" and rep["anchor"].get("textcraft_hash_singleton_group_rate") is not None:
                ax.axhline(rep["anchor"]["textcraft_hash_singleton_group_rate"], ls="--", c="gray", lw=1)
                ax.axhline(rep["anchor"]["textcraft_cluster_singleton_group_rate"], ls=":", c="gray", lw=1)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{part}: {rep['fixed'][part]}", fontsize=9)
        save(fig, f"{part}.png")

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    merge_ms = sorted({r["m"] for r in rep["merge_sweep"]})
    styles = ("-", "--", ":", "-.")
    for ci, n in enumerate(names):
        for j, key in enumerate(("corr", "step_state_err")):
            for mi, mm in enumerate(merge_ms):
                rows = [r for r in rep["merge_sweep"] if r["m"] == mm]
                ax[j].errorbar(
                    [r["false_merge"] for r in rows],
                    [r["summary"][n][key][0] for r in rows],
                    yerr=[r["summary"][n][key][1] for r in rows],
                    marker="o",
                    ms=3,
                    capsize=2,
                    color=f"C{ci}",
                    ls=styles[mi % len(styles)],
                    label=n if mi == 0 else None,
                )
    m_styles = ", ".join(f"m={mm} {styles[i % len(styles)]}" for i, mm in enumerate(merge_ms))
    ax[0].set_title(f"corr(A-hat, A*) vs false-merge rate ({m_styles})", fontsize=9)
    ax[1].set_title("step term: state-side error vs false-merge rate", fontsize=9)
    for a in ax:
        a.set_xlabel("false_merge")
    ax[0].legend(fontsize=7)
    save(fig, "false_merges.png")

    cells = rep["learning"]
    fig, axes = plt.subplots(1, len(cells), figsize=(4.3 * len(cells), 3.6), squeeze=False)
    for ax, cell in zip(axes[0], cells):
        for n in names:
            mu, hw = np.array(cell["curves"][n]["mean"]), np.array(cell["curves"][n]["hw"])
            x = np.arange(mu.size)
            ax.plot(x, mu, label=n)
            ax.fill_between(x, mu - hw, mu + hw, alpha=0.2)
        ax.set_title(
            f"m={cell['m']}, sigma={cell['sigma']}, false_merge={cell['false_merge']}, {cell['policy']}", fontsize=9
        )
        ax.set_xlabel("iteration")
        ax.set_ylabel("exact success J(pi_k)")
    axes[0][0].legend(fontsize=7)
    save(fig, "learning_curves.png")

    if rep.get("branch_sweep"):
        rows = rep["branch_sweep"]
        settings = list(dict.fromkeys(r["branch"] for r in rows))
        ms = sorted({r["m"] for r in rows})
        fig, axes = plt.subplots(1, len(BRANCH_PLOT), figsize=(4.2 * len(BRANCH_PLOT), 3.8))
        for ax, key in zip(axes, BRANCH_PLOT):
            for ci, n in enumerate(names):
                for mi, mm in enumerate(ms):
                    sel = {r["branch"]: r for r in rows if r["m"] == mm}
                    ax.errorbar(
                        range(len(settings)),
                        [sel[b]["summary"][n][key][0] for b in settings],
                        yerr=[sel[b]["summary"][n][key][1] for b in settings],
                        marker="o",
                        ms=3,
                        capsize=2,
                        color=f"C{ci}",
                        ls=styles[mi % len(styles)],
                        label=n if mi == 0 else None,
                    )
            ax.set_xticks(range(len(settings)), settings)
            ax.set_xlabel("branch (turns:children)")
            ax.set_title(key, fontsize=9)
        axes[0].legend(fontsize=7)
        m_styles = ", ".join(f"m={mm} {styles[i % len(styles)]}" for i, mm in enumerate(ms))
        fig.suptitle(f"branching at {rep['batch']['group_size']} games per task group ({m_styles})", fontsize=9)
        save(fig, "branching.png")

    if rep.get("stale_sweep"):
        rows = rep["stale_sweep"]
        drifts = sorted({r["drift"] for r in rows if r["max_staleness"] > 0})
        fig, axes = plt.subplots(1, len(STALE_PLOT) + 2, figsize=(4.2 * (len(STALE_PLOT) + 2), 3.8))
        for ax, key in zip(axes, STALE_PLOT):
            for ci, n in enumerate(names):
                for di, d in enumerate(drifts):
                    sel = [r for r in rows if r["max_staleness"] == 0 or r["drift"] == d]
                    ax.errorbar(
                        [r["max_staleness"] for r in sel],
                        [r["summary"][n][key][0] for r in sel],
                        yerr=[r["summary"][n][key][1] for r in sel],
                        marker="o",
                        ms=3,
                        capsize=2,
                        color=f"C{ci}",
                        ls=styles[di % len(styles)],
                        label=n if di == 0 else None,
                    )
            ax.set_xlabel("max staleness k")
            d_styles = ", ".join(f"drift {d} {styles[i % len(styles)]}" for i, d in enumerate(drifts))
            ax.set_title(f"{key} ({d_styles})", fontsize=8)
        axes[0].legend(fontsize=7)
        learn_rows = rep.get("stale_learning", [])
        j_ax, curve_ax = axes[len(STALE_PLOT)], axes[len(STALE_PLOT) + 1]
        if learn_rows:
            ks = [r["max_staleness"] for r in learn_rows]
            for ci, n in enumerate(names):
                j_ax.errorbar(
                    ks,
                    [r["curves"][n]["mean"][-1] for r in learn_rows],
                    yerr=[r["curves"][n]["hw"][-1] for r in learn_rows],
                    marker="o",
                    ms=3,
                    capsize=2,
                    color=f"C{ci}",
                    label=n,
                )
            j_ax.set_xlabel("max staleness k")
            j_ax.set_title(f"final exact success (drift {learn_rows[0]['drift']} per version)", fontsize=8)
            for ki, r in enumerate(learn_rows):
                for ci, n in enumerate(names):
                    if n in ("gigpo", "bipace_q"):
                        mu = np.array(r["curves"][n]["mean"])
                        curve_ax.plot(
                            np.arange(mu.size),
                            mu,
                            color=f"C{ci}",
                            ls=styles[ki % len(styles)],
                            label=f"{n} k={r['max_staleness']}",
                        )
            curve_ax.set_xlabel("iteration")
            curve_ax.set_title("success curves, GiGPO and BiPACE_Q per k", fontsize=8)
            curve_ax.legend(fontsize=6)
        fig.suptitle(f"staleness: {rep['fixed']['stale_sweep']}", fontsize=9)
        save(fig, "staleness.png")

    fig, axes = plt.subplots(1, len(scatter["est"]), figsize=(3.4 * len(scatter["est"]), 3.3), squeeze=False)
    for ax, (n, est) in zip(axes[0], scatter["est"].items()):
        ax.scatter(scatter["a_star"], est, s=2, alpha=0.3)
        ax.set_title(n, fontsize=9)
        ax.set_xlabel("exact A*")
    axes[0][0].set_ylabel("estimated advantage")
    fig.suptitle(f"one seed's rows, {scatter['cell']}", fontsize=9)
    save(fig, "scatter.png")
    return files


def _branch_name(branch) -> str:
    """(turns, children) as the grid's 'turns:children' item ('none' for independent games)."""
    turns, children = branch
    return "none" if not turns else ",".join(str(t) for t in turns) + f":{children}"


def _num(x) -> str:
    return "none in range" if x is None else f"{x:.2f}"


def _markdown(rep: dict, names: list) -> str:
    lines = [
        "# Credit-assignment lab: the documented grid",
        "",
        f"Command: `{rep['command']}` (commit {rep['commit']}).",
        f"Wall time {rep['wall_s']:.0f} s on {rep['machine']}; load average {rep['load_start']} at the start, "
        f"{rep['load_end']} at the end.",
        f"Seeds per cell: {rep['seeds']} (intervals: mean +- 1.96 std / sqrt(seeds)); per seed "
        f"{rep['batch']['groups']} task groups x {rep['batch']['group_size']} games x horizon {rep['horizon']}.",
        f"Scored policy: recipe-action logit bonus {rep['score_bonus']} (exact success {rep['score_success']:.3f}).",
        "",
    ]

    def table(title, rows, xkey, keys=("corr",)):
        for key in keys:
            lines.append(f"### {title}: {key}")
            lines.append("")
            lines.append(f"| {xkey} | " + " | ".join(names) + " |")
            lines.append("|---|" + "---|" * len(names))
            for r in rows:
                lines.append(f"| {r[xkey]} | " + " | ".join(_fmt(r["summary"][n][key]) for n in names) + " |")
            lines.append("")

    table(f"m sweep ({rep['fixed']['m_sweep']})", rep["m_sweep"], "m", SHOWN)
    table(f"sigma sweep ({rep['fixed']['sigma_sweep']})", rep["sigma_sweep"], "sigma", SHOWN)
    lines.append("### False merges (trap states embedded as their live twin): corr, step-term state-side error")
    lines.append("")
    lines.append(
        "| m | false_merge | "
        + " | ".join(f"{n} corr" for n in names)
        + " | "
        + " | ".join(f"{n} step_state_err" for n in names)
        + " |"
    )
    lines.append("|---|---|" + "---|" * (2 * len(names)))
    for r in rep["merge_sweep"]:
        lines.append(
            f"| {r['m']} | {r['false_merge']} | "
            + " | ".join(_fmt(r["summary"][n]["corr"]) for n in names)
            + " | "
            + " | ".join(_fmt(r["summary"][n]["step_state_err"]) for n in names)
            + " |"
        )
    lines.append("")
    others = [n for n in ("bipace_q", "bipace_diff", "bigpo") if n in names]
    for key in PAIRED:
        lines.append(f"### Paired differences against GiGPO (same batch, per seed): {key}")
        lines.append("")
        lines.append("| part | m | sigma | false_merge | " + " | ".join(f"{n} - gigpo" for n in others) + " |")
        lines.append("|---|---|---|---|" + "---|" * len(others))
        for part in ("m_sweep", "sigma_sweep", "merge_sweep"):
            for r in rep[part]:
                d = r["paired_vs_gigpo"]
                lines.append(
                    f"| {part} | {r['m']} | {r['sigma']} | {r['false_merge']} | "
                    + " | ".join(_fmt(d[n][key]) if d.get(n) else "-" for n in others)
                    + " |"
                )
        lines.append("")
    lines.append(f"### Learning: exact success J(pi_k), {rep['learn']}")
    lines.append("")
    lines.append("Start -> final J (interval over seeds), then the paired final difference against GiGPO.")
    lines.append("")
    lines.append(
        "| cell | "
        + " | ".join(f"{n} J_0 -> J_K" for n in names)
        + " | "
        + " | ".join(f"{n} - gigpo" for n in names if n != "gigpo")
        + " |"
    )
    lines.append("|---|" + "---|" * (2 * len(names) - 1))
    for cell in rep["learning"]:
        label = f"m={cell['m']} sigma={cell['sigma']} false_merge={cell['false_merge']} {cell['policy']}"
        cv = cell["curves"]
        lines.append(
            f"| {label} | "
            + " | ".join(f"{cv[n]['mean'][0]:.3f} -> {cv[n]['mean'][-1]:.3f} +- {cv[n]['hw'][-1]:.3f}" for n in names)
            + " | "
            + " | ".join(
                _fmt(cv[n]["final_vs_gigpo"]) if cv[n].get("final_vs_gigpo") else "-" for n in names if n != "gigpo"
            )
            + " |"
        )
    lines.append("")
    lines.extend(_branch_markdown(rep, names))
    lines.extend(_stale_markdown(rep, names))
    a = rep["anchor"]
    lines.append("### Real-game anchor")
    lines.append("")
    lines.append(
        f"`{a['report']}`: hash singleton-group rate {a.get('textcraft_hash_singleton_group_rate', float('nan')):.3f}, "
        f"cluster singleton-group rate {a.get('textcraft_cluster_singleton_group_rate', float('nan')):.3f} "
        f"(epsilon {a.get('textcraft_epsilon')}). Lab: m = {_num(a.get('m_matching_hash_rate'))} gives GiGPO's hash "
        f"rate (m sweep, linear interpolation), sigma = {_num(a.get('sigma_matching_cluster_rate'))} gives BiGPO's "
        f"cluster rate (sigma sweep, epsilon {rep['epsilon']})."
    )
    lines.append("")
    lines.append("Plots: " + ", ".join(f"`{p}`" for p in rep["plots"]))
    return "\n".join(lines) + "\n"


BRANCH_SHOWN = ("corr", "node_corr", "step_corr", "node_step_corr", "singleton_row_rate", "loo_row_rate")
BRANCH_PLOT = ("corr", "node_corr", "node_step_corr", "singleton_row_rate", "loo_row_rate")
STALE_SHOWN = ("corr", "step_corr", "singleton_row_rate", "mean_group_size")
STALE_PLOT = ("corr", "step_corr", "mean_group_size")


def _learning_rows(rows, names, label, vs: str) -> list[str]:
    """Start -> final J per estimator, the mean whole-advantage corr over iterations, and `vs`'s paired finals."""
    lines = [
        f"| {label} | "
        + " | ".join(f"{n} J_0 -> J_K" for n in names)
        + " | "
        + " | ".join(f"{n} corr" for n in names)
        + " | "
        + " | ".join(f"{n} {vs}" for n in names)
        + " |",
        "|---|" + "---|" * (3 * len(names)),
    ]
    key = {"- gigpo": "final_vs_gigpo", "- k=0": "final_vs_sync"}[vs]
    for r in rows:
        cv = r["curves"]
        lines.append(
            f"| {r[label]} | "
            + " | ".join(f"{cv[n]['mean'][0]:.3f} -> {cv[n]['mean'][-1]:.3f} +- {cv[n]['hw'][-1]:.3f}" for n in names)
            + " | "
            + " | ".join(_fmt(cv[n]["corr"]) for n in names)
            + " | "
            + " | ".join(_fmt(cv[n][key]) if cv[n].get(key) else "-" for n in names)
            + " |"
        )
    return lines + [""]


def _per_score_tables(rows: list, scores, names: list, columns: tuple, cells) -> list[str]:
    """One Markdown table per score in ``scores``: a row per sweep cell (``cells(row)`` fills ``columns``),
    a column per estimator in ``names``."""
    lines = []
    for key in scores:
        lines += [f"#### {key}", "", "| " + " | ".join((*columns, *names)) + " |"]
        lines.append("|" + "---|" * (len(columns) + len(names)))
        for r in rows:
            values = (*(str(c) for c in cells(r)), *(_fmt(r["summary"][n][key]) for n in names))
            lines.append("| " + " | ".join(values) + " |")
        lines.append("")
    return lines


def _branch_markdown(rep: dict, names: list) -> list[str]:
    lines = [
        f"### Branching at the same budget ({rep['fixed']['branch_sweep']}; `batch.branch_turns` / "
        "`batch.branch_children`, the lab's model of `rollout.branch`)",
        "",
        f"Each task group keeps {rep['batch']['group_size']} games; 'turns:children' forks every game at those "
        "turns into that many continuations (the siblings repeat the parent's rows up to the fork and share the "
        "fork turn's observation). `shared obs` is the share of rows that repeat another row's observation.",
        "",
    ]
    lines += _per_score_tables(
        rep["branch_sweep"],
        BRANCH_SHOWN,
        names,
        ("m", "branch", "rows", "shared obs"),
        lambda r: (r["m"], r["branch"], r["rows"], f"{r['shared_obs_rows']:.3f}"),
    )
    if rep.get("branch_learning"):
        r0 = rep["branch_learning"][0]
        lines.append(
            f"#### Learning with branching (m={r0['m']}, sigma={r0['sigma']}, latent policy; exact J; corr: mean "
            "over iterations of the whole advantage's correlation with A*)"
        )
        lines.append("")
        lines.extend(_learning_rows(rep["branch_learning"], names, "branch", "- gigpo"))
    return lines


def _stale_markdown(rep: dict, names: list) -> list[str]:
    lines = [
        f"### Staleness: fingerprint drift with the version lag ({rep['fixed']['stale_sweep']})",
        "",
        "Each game draws a lag l uniformly from 0..k; its rows' fingerprints are those of the model l versions "
        "old (drift per version `view.drift`, `docs/lab.md`). GiGPO reads no fingerprint: its changes are the "
        "batch's draw only.",
        "",
    ]
    lines += _per_score_tables(
        rep["stale_sweep"], STALE_SHOWN, names, ("k", "drift"), lambda r: (r["max_staleness"], r["drift"])
    )
    if rep.get("stale_learning"):
        r0 = rep["stale_learning"][0]
        lines.append(
            f"#### Learning under staleness (m={r0['m']}, sigma={r0['sigma']}, drift {r0['drift']} per version, "
            "latent policy): games play pi_(i-l), l uniform in 0..k; the step is taken at pi_i without importance "
            "correction; corr against A* of pi_i"
        )
        lines.append("")
        lines.extend(_learning_rows(rep["stale_learning"], names, "max_staleness", "- k=0"))
    return lines


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):  # a tree without git still runs
        return "unknown"


def _learn(c, game, view, cfg, policy: str, render_text: bool, branch=None, max_staleness=None) -> dict:
    """`lab.learn` of one estimator with the config's batch, horizon and learning settings (branch
    (turns, children) and max_staleness default to `config.batch`'s)."""
    if branch is None:
        branch = (lab_config.branch_turns(c), c.batch.branch_children)
    return lab.learn(
        game,
        view,
        cfg,
        seeds=c.batch.seeds,
        groups=c.batch.groups,
        group_size=c.batch.group_size,
        horizon=c.game.horizon,
        iterations=c.learn.iterations,
        lr=c.learn.lr,
        policy=policy,
        rng_seed=c.seed,
        render_text=render_text,
        branch_turns=branch[0],
        branch_children=branch[1],
        max_staleness=c.batch.max_staleness if max_staleness is None else max_staleness,
    )


def run_grid(c) -> dict:
    """The documented grid (module docstring); returns the report dict and writes it under config.out."""
    t0 = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    out = c.out or os.path.join(ROOT, "docs", "results", "lab")
    # never over another run's or command's files (a folder of only a grid report's files is one)
    runfolder.claim_output(out, "--config.out", "launch.lab", "grid", ("report.md", "report.json", "*.png"))
    game = lab_config.game(c)
    cfgs = lab_config.estimator_configs(c)
    names = list(cfgs)
    sig0, m0 = c.grid.paraphrases_at_sigma, c.grid.sigma_at_paraphrases
    rep = dict(
        command="python -m launch.lab " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        commit=_git_commit(),
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
        config=json.loads(c.to_json()),
        seeds=c.batch.seeds,
        batch=c.batch.to_dict(),
        horizon=c.game.horizon,
        epsilon=c.estimator.epsilon,
        score_bonus=c.score_bonus,
        score_success=float(lab.success_probability(game, lab.bonus_policy(game, c.score_bonus, 1), c.game.horizon)[0]),
        fixed=dict(
            m_sweep=f"sigma={sig0}",
            sigma_sweep=f"m={m0}",
            merge_sweep=f"sigma={sig0}",
            branch_sweep=f"sigma={sig0}",
            stale_sweep=f"m={c.grid.stale_paraphrases}, sigma={sig0}, the scored policy at every lag (drift only)",
        ),
        learn=f"{c.learn.iterations} iterations, lr {c.learn.lr}, {c.batch.seeds} seeds, from the uniform policy",
    )
    index = 0
    scatter = None
    part_has_branch = part_has_lag = False  # which extra columns the part being run records
    m_stale = c.grid.stale_paraphrases

    def cell(m, sigma, fm, branch=((), 1), max_lag=0, drift=0.0):
        nonlocal index, scatter
        index += 1
        t = time.perf_counter()
        batch, scores, diags = _cell_scores(c, lab, m, sigma, fm, index, game, cfgs, branch, max_lag, drift)
        ro = batch.rollouts
        extra = {}
        if branch[0]:
            extra = dict(
                branch=_branch_name(branch), shared_obs_rows=float(np.mean(ro.obs_source != np.arange(ro.num_rows)))
            )
        elif part_has_branch:
            extra = dict(branch="none", shared_obs_rows=0.0)
        if max_lag > 0 or part_has_lag:
            extra.update(max_staleness=max_lag, drift=drift)
        row = dict(
            m=m,
            sigma=sigma,
            false_merge=fm,
            **extra,
            summary=_summary(scores),
            paired_vs_gigpo={n: _paired(scores, n, "gigpo") for n in names if n != "gigpo"},
            diagnostics=diags,
            rows=int(batch.rollouts.num_rows),
            seconds=round(time.perf_counter() - t, 2),
        )
        if scatter is None and m >= 8 and sigma > 0:
            keep = batch.rollouts.seed == 0
            est = {}
            for n in ("gigpo", "bigpo", "bipace_q", "bipace_diff", "hgpo"):
                if n in cfgs:
                    est[n] = lab.estimate(batch, cfgs[n])[0][keep].tolist()
            scatter = dict(cell=f"m={m}, sigma={sigma}", a_star=batch.a_star[keep].tolist(), est=est)
            rep["scatter"] = scatter  # the plot's points, so the plots can be redrawn from report.json
        print(
            f"m={m:<4d} sigma={sigma:<5g} false_merge={fm:<5g} "
            + "".join(f"{k}={extra[k]} " for k in ("branch", "max_staleness", "drift") if k in extra)
            + " ".join(f"{n}:{row['summary'][n]['corr'][0]:.3f}" for n in names)
            + f"  ({row['seconds']} s)",
            flush=True,
        )
        return row

    rep["m_sweep"] = [cell(m, sig0, 0.0) for m in lab_config.parse_list(c, "grid.paraphrases", int)]
    rep["sigma_sweep"] = [cell(m0, s, 0.0) for s in lab_config.parse_list(c, "grid.sigmas", float)]
    rep["merge_sweep"] = [
        cell(m, sig0, fm)
        for m in lab_config.parse_list(c, "grid.merge_paraphrases", int)
        for fm in lab_config.parse_list(c, "grid.false_merges", float)
    ]
    part_has_branch = True
    rep["branch_sweep"] = [
        cell(m, sig0, 0.0, branch=b)
        for m in lab_config.parse_list(c, "grid.branch_paraphrases", int)
        for b in lab_config.branch_settings(c, "grid.branch")
    ]
    part_has_branch, part_has_lag = False, True
    rep["stale_sweep"] = [
        cell(m_stale, sig0, 0.0, max_lag=k, drift=d)
        for k in lab_config.parse_list(c, "grid.staleness", int)
        for d in (lab_config.parse_list(c, "grid.drifts", float) if k > 0 else [0.0])
    ]
    part_has_lag = False

    def learning(m, sigma, fm, policy, **kw):
        view = lab_config.view(c, paraphrases=m, sigma=sigma, false_merge=fm, drift=kw.pop("drift", 0.0))
        t = time.perf_counter()
        curves, finals = {}, {}
        for n, cfg in cfgs.items():
            r = _learn(c, game, view, cfg, policy, render_text=False, **kw)
            ivs = [lab_interval(r["success"][k]) for k in range(r["success"].shape[0])]
            curves[n] = dict(
                mean=[iv[0] for iv in ivs],
                hw=[iv[1] for iv in ivs],
                corr=lab_interval(r["corr"].mean(axis=0)),
                singleton_row_rate=lab_interval(r["singleton_row_rate"].mean(axis=0)),
            )
            finals[n] = r["success"][-1]
        for n in curves:
            # Paired over seeds: every arm starts from the same rng seed.
            curves[n]["final_vs_gigpo"] = lab_interval(finals[n] - finals["gigpo"]) if "gigpo" in finals else None
        row = dict(m=m, sigma=sigma, false_merge=fm, policy=policy, curves=curves)
        row["seconds"] = round(time.perf_counter() - t, 1)
        print(
            f"learning m={m} sigma={sigma} false_merge={fm} {policy} policy {view.drift=} "
            + " ".join(f"{k}={v}" for k, v in kw.items())
            + ": "
            + " ".join(f"{n}:{curves[n]['mean'][-1]:.3f}" for n in names)
            + f"  ({row['seconds']} s)",
            flush=True,
        )
        return row, finals

    rep["learning"] = [learning(*cell_args)[0] for cell_args in lab_config.learning_cells(c)]
    rep["branch_learning"] = []
    m_bl = c.grid.branch_learning_paraphrases
    for b in lab_config.branch_settings(c, "grid.branch_learning"):
        row, _ = learning(m_bl, sig0, 0.0, "latent", branch=b, max_staleness=0)
        rep["branch_learning"].append(dict(row, branch=_branch_name(b)))
    rep["stale_learning"] = []
    sync = None
    for k in lab_config.parse_list(c, "grid.staleness", int):
        d = c.grid.stale_learning_drift
        row, finals = learning(m_stale, sig0, 0.0, "latent", branch=((), 1), max_staleness=k, drift=d)
        row.update(max_staleness=k, drift=d)
        if k == 0:
            sync = finals
        elif sync is not None:
            for n in names:  # paired against k = 0 (same rng seed, same start)
                row["curves"][n]["final_vs_sync"] = lab_interval(finals[n] - sync[n])
        rep["stale_learning"].append(row)
    rep["anchor"] = lab.anchor(c.grid.anchor_report, rep["m_sweep"], rep["sigma_sweep"], root=ROOT)
    write_json(os.path.join(out, "report.json"), rep, indent=1)  # kept should a plot fail
    rep["plots"] = _plots(out, rep, names, scatter)
    rep["wall_s"] = time.perf_counter() - t0
    rep["load_end"] = [round(x, 2) for x in os.getloadavg()]
    rep["load_start"] = load_start
    write_json(os.path.join(out, "report.json"), rep, indent=1)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(_markdown(rep, names))
    print(f"wrote {os.path.join(out, 'report.md')} ({rep['wall_s']:.0f} s)")
    return rep


def run_cell(c) -> dict:
    """One cell: every estimator's scores on `config.view` and its learning curve; prints a table."""
    t0 = time.perf_counter()
    game = lab_config.game(c)
    cfgs = lab_config.estimator_configs(c)
    v = c.view
    branch = (lab_config.branch_turns(c), c.batch.branch_children)
    _, scores, _ = _cell_scores(
        c, lab, v.paraphrases, v.sigma, v.false_merge, 0, game, cfgs, branch, c.batch.max_staleness, v.drift
    )
    summary = _summary(scores)
    view = lab_config.view(c)
    final = {}
    for n, cfg in cfgs.items():
        r = _learn(c, game, view, cfg, c.learn.policy, render_text=c.render_text)
        final[n] = dict(start=lab_interval(r["success"][0]), final=lab_interval(r["success"][-1]))
    print(f"{'estimator':12s} " + " ".join(f"{k:>17s}" for k in SHOWN) + f" {'final J':>17s}")
    for n in cfgs:
        print(f"{n:12s} " + " ".join(f"{_fmt(summary[n][k]):>17s}" for k in SHOWN) + f" {_fmt(final[n]['final']):>17s}")
    rep = dict(
        command="python -m launch.lab " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        config=json.loads(c.to_json()),
        scores=summary,
        learning=final,
        wall_s=time.perf_counter() - t0,
        load=[round(x, 2) for x in os.getloadavg()],
    )
    write_json(c.out or os.path.join(ROOT, "benchmarks", "lab.json"), rep, indent=1)
    return rep


def main(argv):
    c = _CONFIG.value
    try:
        lab_config.validate(c)
        del argv  # absl already parsed the flags
        run_grid(c) if c.mode == "grid" else run_cell(c)
    except (ConfigError, runfolder.RunFolderError) as e:  # one line, never a traceback
        cli.fail(str(e))


if __name__ == "__main__":
    cli.run(main)
