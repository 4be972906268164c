"""The run folder layer (``bipace_jax.runfolder``) and a whole run on a fake GCS bucket.

The fake: ``gs://`` URLs are served by an fsspec filesystem rooted in a local "bucket" folder (what
etils.epath uses for gs:// with gcsfs), and orbax's TensorStore writes its arrays under the same root
(its GCS kvstore is swapped for a file kvstore there). Every test runs in an empty working directory
with ``tempfile`` pointed at a folder of its own, and checks that nothing but the bucket was written:
no ``gs:`` folder in the working directory, no staging folder left behind.
"""

import importlib
import json
import os

import jax
import numpy as np
import optax
import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from orbax.checkpoint._src.path import gcs_utils

from bipace_jax import runfolder
from bipace_jax.checkpointing import Checkpointer
from bipace_jax.metrics import MetricsLogger, read_metrics
from bipace_jax.plots import make_plots

RUN = "gs://fake-bucket/runs/r1"


class _FakeGCS(DirFileSystem):
    """gs://bucket/key -> <root>/bucket/key on the local disk."""

    protocol = ("gs", "gcs")
    cachable = False  # a new root per test
    root = ""

    def __init__(self, *args, **kwargs):
        super().__init__(path=type(self).root, fs=LocalFileSystem())

    def open(self, path, mode="rb", **kwargs):
        if any(m in mode for m in "wa"):  # objects need no folders, only an existing bucket
            bucket = self._strip_protocol(path).split("/")[0]
            if not os.path.isdir(os.path.join(type(self).root, bucket)):
                raise FileNotFoundError(f"no bucket {bucket}")
            self.makedirs(self._parent(path), exist_ok=True)
        return super().open(path, mode, **kwargs)


def _files(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
    """(bucket root on disk, working directory, temp folder); asserts afterwards that the working
    directory and the temp folder stayed empty."""
    root, cwd, tmp = (tmp_path / n for n in ("gcs", "cwd", "tmp"))
    for d in (root / "fake-bucket", cwd, tmp):
        d.mkdir(parents=True)
    monkeypatch.setattr(_FakeGCS, "root", str(root))
    for proto in _FakeGCS.protocol:
        monkeypatch.setitem(importlib.import_module("fsspec.registry")._registry, proto, _FakeGCS)
    epath_backend.fsspec_backend._get_filesystem.cache_clear()

    def kvstore(path):  # orbax's TensorStore spec for a gs:// path, on the fake's root
        bucket, key = gcs_utils.parse_gcs_path(path, add_trailing_slash=False)
        return {"driver": "file", "path": os.path.join(root, bucket, key)}

    monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs", kvstore)
    monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
    monkeypatch.setattr(runfolder, "_missing_gcp_packages", lambda: [])
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    monkeypatch.chdir(cwd)
    yield root, cwd, tmp
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
    runfolder.drop_local_folders()  # a model folder's copy is kept until the process exits
    assert _files(cwd) == [] and os.listdir(cwd) == [], "written outside the bucket (working directory)"
    assert os.listdir(tmp) == [], "a staging folder was left behind"


def test_path_makes_local_folders_absolute_and_keeps_gs_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert str(runfolder.path("runs/a")) == os.path.join(str(tmp_path), "runs", "a")
    assert str(runfolder.path("gs://b/x/y")) == "gs://b/x/y"
    assert runfolder.is_remote("gs://b/x") and not runfolder.is_remote("runs/a")


@pytest.mark.parametrize("bad", ["memory://run", "s3://b/run", ""])
def test_other_schemes_and_empty_folders_are_refused_naming_the_flag(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(runfolder.RunFolderError, match=r"--workdir.*expected a writable local folder or a gs://"):
        runfolder.prepare(bad)
    assert os.listdir(tmp_path) == []  # no local "memory:" folder


def test_prepare_names_the_flag_and_the_cause_when_the_folder_cannot_be_written(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(runfolder.RunFolderError, match=r"--workdir=.*file/run: cannot create or write.*gs://bucket"):
        runfolder.prepare(str(tmp_path / "file" / "run"))
    assert runfolder.prepare(str(tmp_path / "ok")) == runfolder.path(str(tmp_path / "ok"))
    assert os.listdir(tmp_path / "ok") == []  # the probe file is removed


def test_gs_without_the_gcp_packages_names_the_extra(monkeypatch):
    monkeypatch.setattr(runfolder, "_missing_gcp_packages", lambda: ["gcsfs"])
    with pytest.raises(runfolder.RunFolderError, match=r"--workdir=gs://b/run: .*gcsfs.*\[gcp\]"):
        runfolder.prepare("gs://b/run")


def test_a_missing_bucket_fails_naming_the_flag_and_is_not_created(fake_gcs):
    root, _, _ = fake_gcs
    with pytest.raises(runfolder.RunFolderError, match=r"--workdir=gs://no-such-bucket/run: cannot create or write"):
        runfolder.prepare("gs://no-such-bucket/run")
    assert os.listdir(root) == ["fake-bucket"]


def test_files_staged_folders_and_copies_round_trip_through_the_bucket(fake_gcs):
    root, _, _ = fake_gcs
    run = runfolder.prepare(RUN)
    runfolder.write_text(run / "a.json", '{"x": 1}')
    runfolder.write_text(run / "a.json", '{"x": 2}')
    assert runfolder.read_text(run / "a.json") == '{"x": 2}' and runfolder.read_text(run / "none") is None
    with runfolder.staged(run / "tok") as local:
        os.makedirs(os.path.join(local, "sub"))
        for name in ("t.json", os.path.join("sub", "s.bin")):
            with open(os.path.join(local, name), "wb") as f:
                f.write(name.encode())
    with runfolder.local_copy(run / "tok") as local:
        assert _files(local) == ["sub/s.bin", "t.json"]
        assert open(os.path.join(local, "sub", "s.bin"), "rb").read() == b"sub/s.bin"
    assert _files(root) == [
        "fake-bucket/runs/r1/a.json",
        "fake-bucket/runs/r1/tok/sub/s.bin",
        "fake-bucket/runs/r1/tok/t.json",
    ]


def test_metrics_events_and_plots_on_gcs_resume_without_lost_or_repeated_rows(fake_gcs):
    root, _, _ = fake_gcs
    bucket_run = root / "fake-bucket" / "runs" / "r1"
    m = MetricsLogger(RUN)
    for i in range(3):
        m.write(i, {"train/success_rate": 0.1 * i})
    m.close()
    m = MetricsLogger(RUN, start_iteration=2)  # iteration 2 is re-run after a restart
    assert [r["iteration"] for r in read_metrics(RUN)] == [0, 1]
    m.write(2, {"train/success_rate": 0.9})
    m.write(3, {"train/success_rate": 1.0})
    m.close()
    rows = [json.loads(line) for line in (bucket_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3] and rows[2]["train/success_rate"] == 0.9
    events = os.listdir(bucket_run / "tb")
    assert len(events) == 2 and all((bucket_run / "tb" / e).stat().st_size > 0 for e in events)
    paths = make_plots(RUN)
    assert paths[0] == RUN + "/plots/success.png"
    assert (bucket_run / "plots" / "success.png").read_bytes()[:4] == b"\x89PNG"


def test_checkpoints_save_and_restore_on_gcs(fake_gcs):
    root, _, _ = fake_gcs
    params = {"w": jax.numpy.arange(6.0).reshape(2, 3)}
    opt = optax.adam(1e-3).init(params)
    ck = Checkpointer(RUN, keep=2)
    assert ck.directory == RUN + "/checkpoints"
    for step in (1, 2, 3):
        ck.save(step, jax.tree.map(lambda x, s=step: x + s, params), opt, jax.random.PRNGKey(step), {"iteration": step})
    ck.close()
    ck = Checkpointer(RUN, keep=2)
    step, (p, _, _, meta) = ck.restore_latest(params, opt)
    ck.close()
    assert step == 3 and meta["iteration"] == 3 and ck.all_steps() == [2, 3]
    np.testing.assert_array_equal(p["w"], params["w"] + 3)
    assert sorted(os.listdir(root / "fake-bucket" / "runs" / "r1" / "checkpoints")) == ["2", "3"]


TINY = {
    "model.checkpoint": "",  # a random tiny actor: the tokenizer is trained and saved into the run folder
    "model.hidden_size": 32,
    "model.num_layers": 1,
    "model.num_heads": 2,
    "model.num_kv_heads": 1,
    "model.intermediate_size": 64,
    "rollout.num_groups": 2,
    "rollout.group_size": 2,
    "env.max_steps": 3,
    "env.num_workers": 1,
    "sampler.max_new_tokens": 16,
    "sampler.batch_buckets": (4, 8),
    "val.num_tasks": 2,
    "val.num_holdout_tasks": 1,
    "val.every": 1,
    "val.seeds_per_goal": 1,
    "ppo.micro_batch_rows": 8,
    "log.progress": False,
}


def _tiny_config(num_iterations):
    import configs.textcraft_tiny

    c = configs.textcraft_tiny.get_config()
    for key, value in {**TINY, "num_iterations": num_iterations}.items():
        *parents, leaf = key.split(".")
        node = c
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


@pytest.mark.e2e
def test_tiny_default_runs_on_gcs_and_resumes_from_it(fake_gcs):
    from bipace_jax.trainer import Trainer

    root, _, _ = fake_gcs
    bucket_run = root / "fake-bucket" / "runs" / "r1"
    tr = Trainer(_tiny_config(1), RUN)
    try:
        first = tr.run()
    finally:
        tr.close()
    assert first["iterations_run"] == 1 and first["hf_export"] == RUN + "/hf_final"
    files = _files(bucket_run)
    for f in ("config.json", "metrics.jsonl", "tokenizer/tokenizer.json", "hf_final/config.json", "plots/success.png"):
        assert f in files, (f, files)
    assert any(f.startswith("tb/events") for f in files) and any(f.startswith("checkpoints/1/") for f in files)

    tr = Trainer(_tiny_config(2), RUN)  # the same folder again: resumes from its checkpoint and tokenizer
    try:
        assert tr.iteration == 1
        second = tr.run()
    finally:
        tr.close()
    assert second["start_iteration"] == 1 and second["iterations_run"] == 1
    rows = read_metrics(RUN)
    assert [r["iteration"] for r in rows] == [0, 1] and rows[1]["train/task_cursor"] == 2
    assert sorted(os.listdir(bucket_run / "checkpoints")) == ["1", "2"]
    assert len(os.listdir(bucket_run / "tb")) == 2


def test_report_reads_a_study_on_gcs_and_writes_its_plots_there(fake_gcs):
    from launch import report

    root, _, _ = fake_gcs
    study = "gs://fake-bucket/study"
    for name, seed in (("grpo", 0), ("grpo", 1), ("bipace_q", 0)):
        run = runfolder.prepare(f"{study}/{name}_{seed}")
        runfolder.write_text(run / "config.json", json.dumps({"seed": seed, "estimator": {"name": name}}))
        runfolder.write_text(run / "metrics.jsonl", json.dumps({"iteration": 0, "val/success_rate": 0.5}) + "\n")
    runs = report.find_runs([study])
    assert runs == [f"{study}/bipace_q_0", f"{study}/grpo_0", f"{study}/grpo_1"]
    assert sorted(report.arms_of(runs)) == ["estimator.name=bipace_q", "estimator.name=grpo"]
    plots = report.plot(report.aggregate(report.arms_of(runs), 0.9), study)
    assert plots and set(plots) <= set(os.listdir(root / "fake-bucket" / "study"))


def test_a_sweep_cell_log_on_gcs_is_copied_up_and_appended_whole(fake_gcs):
    from launch import sweep

    root, _, _ = fake_gcs
    run_dir = "gs://fake-bucket/study/seed=0"
    for attempt in ("first\n", "second\n"):  # a retried cell: both attempts' output, in order
        log, path = sweep._open_log(run_dir, "seed=0")
        assert not path.startswith(str(root))  # a local file: the child process writes to it
        log.write(attempt)
        sweep._close_log(log, run_dir)
    assert (root / "fake-bucket" / "study" / "seed=0" / "train.log").read_text() == "first\nsecond\n"


SHIPPED = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bipace_jax", "data", "textcraft_tiny"
)
MODEL = "gs://fake-bucket/models/textcraft_tiny"


def _with_checkpoint(checkpoint):
    import configs.textcraft_tiny

    c = configs.textcraft_tiny.get_config()
    c.model.checkpoint = checkpoint
    return c


@pytest.mark.slow  # 6 s on 2 cores, 3 s of it importing transformers
def test_a_gs_checkpoint_loads_the_weights_tokenizer_and_stop_ids_of_the_same_local_folder(fake_gcs):
    import shutil

    from flax import nnx

    from bipace_jax import build

    root, _, tmp = fake_gcs
    shutil.copytree(SHIPPED, root / "fake-bucket" / "models" / "textcraft_tiny")
    remote, local = (build.build_spec(_with_checkpoint(ck)).model for ck in (MODEL, SHIPPED))
    assert remote.checkpoint == MODEL and local.checkpoint == SHIPPED
    assert os.listdir(tmp) == []  # the spec only checks the folder: nothing is copied yet

    loaded = {}
    for name, m in (("remote", remote), ("local", local)):
        tok = build.load_model_tokenizer(m)
        actor = build.build_actor(m, tok)
        stops = build.stop_token_ids(actor.config.eos_token_ids, tok, m.checkpoint)
        loaded[name] = (tok, nnx.to_flat_state(nnx.state(actor, nnx.Param)), stops)
    (tok_r, params_r, stops_r), (tok_l, params_l, stops_l) = loaded["remote"], loaded["local"]

    text = "<|im_start|>user\ncraft 1 oak planks<|im_end|>"
    assert tok_r.get_vocab() == tok_l.get_vocab() and len(tok_r) == 1624
    assert tok_r(text)["input_ids"] == tok_l(text)["input_ids"] and tok_r.chat_template == tok_l.chat_template
    assert tok_r.convert_tokens_to_ids("<|im_end|>") == tok_r.eos_token_id == 2
    assert stops_r == stops_l == (2,)  # config.json, generation_config.json and the tokenizer's <|im_end|>
    assert [k for k, _ in params_r] == [k for k, _ in params_l] and len(params_l) > 10
    for (key, a), (_, b) in zip(params_r, params_l):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(key))

    # one copy for the whole process (tokenizer, weights, stop ids); a local folder is never copied
    (staged,) = os.listdir(tmp)
    assert runfolder.local_folder(MODEL) == runfolder.local_folder(MODEL + "/") == os.path.join(tmp, staged)
    assert _files(os.path.join(tmp, staged)) == _files(SHIPPED)
    assert runfolder.local_folder(SHIPPED) == SHIPPED
    runfolder.drop_local_folders()
    assert os.listdir(tmp) == []


@pytest.mark.parametrize(
    "url", ["gs://fake-bucket/models/none", "gs://fake-bucket/models/no_config", "gs://no-such-bucket/models/q"]
)
def test_a_gs_checkpoint_without_config_json_fails_naming_the_field(fake_gcs, url):
    from bipace_jax import build
    from bipace_jax.config import ConfigError

    root, _, tmp = fake_gcs
    (root / "fake-bucket" / "models" / "no_config").mkdir(parents=True)
    (root / "fake-bucket" / "models" / "no_config" / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        build.build_spec(_with_checkpoint(url))
    why = "it has none" if url.endswith("no_config") else "no such folder"
    assert str(e.value) == (
        f"config.model.checkpoint must be a Hugging Face folder holding config.json ({why}; e.g. a run's "
        f"hf_final/ or a downloaded model; --config.model.checkpoint= for a random tiny init), got '{url}'"
    )
    assert os.listdir(tmp) == []


@pytest.mark.parametrize("field", ["checkpoint", "tokenizer"])
def test_a_gs_model_folder_without_the_gcp_packages_names_the_extra(monkeypatch, field):
    from bipace_jax import build
    from bipace_jax.config import ConfigError

    monkeypatch.setattr(runfolder, "_missing_gcp_packages", lambda: ["gcsfs", "google-cloud-storage"])
    c = _with_checkpoint("gs://b/qwen" if field == "checkpoint" else SHIPPED)
    c.model.tokenizer = "gs://b/qwen" if field == "tokenizer" else ""
    with pytest.raises(ConfigError) as e:
        build.build_spec(c)
    assert str(e.value) == (
        f"config.model.{field}=gs://b/qwen: a gs:// folder needs gcsfs, google-cloud-storage "
        "(pip install -e '.[gcp]'); expected a local or gs:// folder"
    )


def test_a_model_folder_of_another_scheme_is_refused_naming_the_field():
    from bipace_jax import build
    from bipace_jax.config import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"^config\.model\.checkpoint must be a local or gs:// folder \(unsupported scheme\), got 's3://b/q'$",
    ):
        build.build_spec(_with_checkpoint("s3://b/q"))


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("where", ["local", "gs"])
def test_a_second_run_refuses_a_held_folder_and_a_crashed_runs_lock_is_taken_over(tmp_path, where, request):
    # the case 4: a second launch.train with the same --workdir joined the first
    if where == "gs":
        request.getfixturevalue("fake_gcs")
        folder = RUN
    else:
        folder = str(tmp_path / "run")
    first = runfolder.RunLock(folder, "process_0", "launch.train", settle_s=0.05).acquire()
    second = runfolder.RunLock(folder, "process_0", "launch.train", settle_s=0.05)
    with pytest.raises(
        runfolder.RunFolderBusy, match=r"--workdir=.*(run|r1) is in use by launch.train \(host .*, pid \d+"
    ):
        second.acquire()
    assert "\n" not in second.busy_message("x")
    other = runfolder.RunLock(folder, "process_1", "launch.train", settle_s=0.05).acquire()  # another name: its own
    other.release()
    first.release()
    assert not first.file.exists()
    second.acquire().release()  # released: free again

    # a crashed run: its record stays, its process is gone (this host) -> the resume takes over at once
    record = {"token": "t", "host": __import__("socket").gethostname(), "pid": _dead_pid(), "command": "launch.train"}
    runfolder.write_text(first.file, json.dumps({**record, "heartbeat": __import__("time").time()}))
    resumed = runfolder.RunLock(folder, "process_0", "launch.train", settle_s=0.05).acquire()
    assert json.loads(first.file.read_text())["token"] == resumed.token
    resumed.release()
    # a live holder on this host holds it, however old its heartbeat (a process stopped for a while)
    runfolder.write_text(first.file, json.dumps({**record, "pid": os.getpid(), "heartbeat": 0.0}))
    with pytest.raises(runfolder.RunFolderBusy, match=f"pid {os.getpid()}"):
        runfolder.RunLock(folder, "process_0", "launch.train", settle_s=0.05).acquire()
    # a holder on another host is judged by its heartbeat: fresh -> busy, older than stale_s -> taken over
    far = {**record, "host": "other-host", "pid": 1}
    runfolder.write_text(first.file, json.dumps({**far, "heartbeat": __import__("time").time()}))
    with pytest.raises(runfolder.RunFolderBusy, match="host other-host"):
        runfolder.RunLock(folder, "process_0", "launch.train", settle_s=0.05).acquire()
    runfolder.write_text(first.file, json.dumps({**far, "heartbeat": __import__("time").time() - 61}))
    runfolder.RunLock(folder, "process_0", "launch.train", settle_s=0.05).acquire().release()


def test_a_held_lock_keeps_beating(tmp_path):
    import time

    lock = runfolder.RunLock(str(tmp_path), "process_0", "launch.train", beat_s=0.1, stale_s=0.5).acquire()
    first = json.loads(lock.file.read_text())["heartbeat"]
    time.sleep(0.6)
    assert json.loads(lock.file.read_text())["heartbeat"] > first  # a live holder never goes stale
    lock.release()


def test_check_writable_creates_nothing_and_refuses_what_prepare_refuses(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(runfolder.RunFolderError, match=r"--workdir=.*file/run: cannot create or write"):
        runfolder.check_writable(str(tmp_path / "file" / "run"))
    runfolder.check_writable(str(tmp_path / "new" / "run"))
    assert sorted(os.listdir(tmp_path)) == ["file"]  # nothing made, no probe left
    with pytest.raises(runfolder.RunFolderError, match=r"--workdir=/proc/run: cannot create or write"):
        runfolder.check_writable("/proc/run")  # a read-only file system, even for root


def test_results_never_go_over_another_run_or_command_and_a_rerun_replaces_its_own(tmp_path):
    # the case 9: results written into a folder never overwrite another run's or command's files
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "config.json").write_text("{}")
    with pytest.raises(
        runfolder.RunFolderError, match=r"--out=.*run holds files launch.eval did not write \(metrics.jsonl\)"
    ):
        runfolder.claim_output(str(run), "--out", "launch.eval", "ckpt A", ("eval.json", "report.md", "config.json"))
    assert sorted(os.listdir(run)) == ["config.json", "metrics.jsonl"]  # nothing written

    out = str(tmp_path / "out")
    runfolder.claim_output(out, "--out", "launch.eval", "ckpt A", ("eval.json",))
    (tmp_path / "out" / "eval.json").write_text("{}")
    runfolder.claim_output(out, "--out", "launch.eval", "ckpt A", ("eval.json",))  # its own re-run
    with pytest.raises(
        runfolder.RunFolderError, match=r"holds the results of launch.eval on ckpt A, not of launch.eval on ckpt B"
    ):
        runfolder.claim_output(out, "--out", "launch.eval", "ckpt B", ("eval.json",))
    with pytest.raises(
        runfolder.RunFolderError, match=r"holds the results of launch.eval on ckpt A, not of launch.report"
    ):
        runfolder.claim_output(out, "--out", "launch.report", "ckpt A", ("*.json",))

    older = tmp_path / "older_report"  # a report folder written before folders were claimed: still its own
    older.mkdir()
    for name in ("report.md", "report.json", "learning_curves.png"):
        (older / name).write_text("x")
    runfolder.claim_output(str(older), "--out", "launch.report", "study", ("report.md", "report.json", "*.png"))


def test_two_checkpoints_never_share_a_default_eval_folder(tmp_path):
    import subprocess
    import sys

    # launch.eval defines its flags on import (its --out would clash with launch.report's here)
    script = (
        "import json, sys; from launch.eval import default_out as d; "
        "print(json.dumps([d('a/run/hf_final'), d('b/run/hf_final'), d('a/run/hf_final/'), d(sys.argv[1]), "
        "d('gs://b/x/ckpt'), d('gs://c/x/ckpt')]))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "a/run/hf_final")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b, a_slash, a_abs, gs_b, gs_c = json.loads(proc.stdout.strip().splitlines()[-1])
    assert a != b and a.startswith("runs/eval/run_hf_final~") and b.startswith("runs/eval/run_hf_final~")
    assert a == a_slash == a_abs  # one checkpoint, however it is spelt
    assert gs_b != gs_c
