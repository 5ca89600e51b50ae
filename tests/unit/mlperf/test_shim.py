"""#42 item 1: the folder `kvtier mlperf shim DIR` writes (kv-cache.py, mlperf_wrapper.py, config.yaml), and the
wrapper's rank arithmetic and honesty rules. tests/integration/test_mlpstorage_contract.py runs mlpstorage's own
command lines against the folder."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
from pathlib import Path

import pytest
import yaml

from kvtier.config.tuning import Tuning, load_tuning
from kvtier.engine.runs import system_directory
from kvtier.mlperf import wrapper
from kvtier.mlperf.shim import write_shim

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "mlperf_config.yaml"


@pytest.fixture
def shim(tmp_path: Path) -> Path:
    write_shim(tmp_path / "bin")
    return tmp_path / "bin"


def test_the_folder_holds_what_mlpstorage_and_the_reference_scripts_run(shim: Path):
    assert sorted(p.name for p in shim.iterdir()) == ["config.yaml", "kv-cache.py", "mlperf_wrapper.py"]
    for name in ("kv-cache.py", "mlperf_wrapper.py"):
        mode = (shim / name).stat().st_mode
        assert mode & stat.S_IXUSR and (shim / name).read_text().startswith(f"#!{sys.executable}\n")
    assert '"-m", "kvtier", "bench"' in (shim / "kv-cache.py").read_text()
    assert '"-m", "kvtier.mlperf.wrapper"' in (shim / "mlperf_wrapper.py").read_text()


@pytest.mark.parametrize("name", ["kv-cache.py", "mlperf_wrapper.py"])
def test_importing_a_shim_script_runs_nothing(shim: Path, name: str, monkeypatch):
    """The reference's own test suite imports kv-cache.py beside it: the old shim replaced the process on import."""
    calls: list[object] = []
    monkeypatch.setattr(os, "execv", lambda *a: calls.append(a))
    spec = importlib.util.spec_from_file_location("shim_under_test", shim / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert calls == [] and module.PYTHON == sys.executable and callable(module.main)
    monkeypatch.setattr(sys, "argv", [name, "--model", "tiny-1b"])
    module.main()  # what __main__ runs: the interpreter kvtier lives in, the same argv
    (python, argv), = calls  # fmt: skip
    assert python == sys.executable and argv[0] == sys.executable and argv[-2:] == ["--model", "tiny-1b"]


def _flat(d: object, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    if isinstance(d, dict):
        out: dict[tuple[str, ...], object] = {}
        for k, v in d.items():
            out.update(_flat(v, (*path, str(k))))
        return out
    return {path: d}


def test_the_config_is_the_references_and_loads_as_kvtiers_defaults(shim: Path):
    ours = _flat(yaml.safe_load((shim / "config.yaml").read_text()))
    ref = _flat(yaml.safe_load(FIXTURE.read_text()))
    missing = [k for k in ref if k not in ours]
    assert not missing, missing
    # names are display text
    differ = {
        k: (ref[k], ours.get(k))
        for k in ref
        if k[-1] != "name" and ref[k] != ours[k]
    }  # fmt: skip
    assert not differ, differ
    loaded = load_tuning(shim / "config.yaml")
    assert loaded.model_dump(exclude={"model_configs", "sharegpt"}) == Tuning().model_dump(
        exclude={"model_configs", "sharegpt"}
    )
    assert loaded.sharegpt.max_context_tokens == 8192  # the file's cap (kvtier's own default: none, as the code)
    assert loaded.model_configs["qwen3-32b"].kv_dim_per_head == 128  # the reference's file and code: 128-wide heads


def test_rank_and_environment_follow_the_launcher():
    assert wrapper.rank_from({}) == 0
    assert wrapper.rank_from({"OMPI_COMM_WORLD_RANK": "3", "PMI_RANK": "9"}) == 3
    assert wrapper.rank_from({"PMIX_RANK": "2"}) == 2 and wrapper.rank_from({"PMI_RANK": "5"}) == 5
    with pytest.raises(wrapper.WrapperError, match="OMPI_COMM_WORLD_RANK='x'"):
        wrapper.rank_from({"OMPI_COMM_WORLD_RANK": "x"})
    env = {"OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "2", "PATH": "/bin"}
    assert wrapper.bench_environment(env) == {"PATH": "/bin"}  # kvtier bench runs alone, not as a rank
    assert wrapper.default_delay({}) == 90 and wrapper.default_delay({wrapper.DELAY_ENV: "0"}) == 0
    with pytest.raises(wrapper.WrapperError):
        wrapper.default_delay({wrapper.DELAY_ENV: "-1"})


def test_the_per_rank_arguments_come_last_so_they_win():
    cmd = wrapper.bench_command(["--seed", "1", "--model", "tiny-1b"], 43, Path("/r/out.json"), Path("/c/rank_1"))
    assert cmd[1:4] == ["-m", "kvtier", "bench"] and cmd[-6:] == [
        "--seed", "43", "--output", "/r/out.json", "--cache-dir", "/c/rank_1",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "status,rc,code", [("complete", 0, 0), ("partial", 130, 130), ("failed", 1, 1), ("complete", 5, 5)]
)
def test_only_a_complete_run_is_left_where_mlpstorage_reads(tmp_path: Path, status, rc, code):
    own = tmp_path / "kvtier_result_S.json"  # where the bench wrote it: the file its closing lines name
    own.write_text(json.dumps({"status": status}))
    final, exit_code = wrapper.settle(own, tmp_path, "S", rc)
    assert final == own and exit_code == code and own.exists()  # the file the bench named is still there
    assert [p.name for p in tmp_path.glob(wrapper.RESULT_GLOB)] == (["kvcache_results_S.json"] if code == 0 else [])


def test_null_percentiles_are_left_out_as_the_reference_does(tmp_path: Path):
    """mlpstorage 3.0.26 takes the max over ranks of .get('storage_read_device_p95_ms', 0.0): a null stopped its
    whole run when the CPU tier held every entry. The reference writes no key without samples."""
    kvtier_result = {"status": "complete", "summary": {"cache_stats": {
        "storage_read_device_p95_ms": None, "storage_write_device_p95_ms": 3.5, "cpu_read_p50_ms": None,
        "tier_storage_read_bandwidth_gbps": 0.0, "storage_entries": 0, "storage_health": None}}}  # fmt: skip
    own = tmp_path / "kvtier_result_S.json"
    own.write_text(json.dumps(kvtier_result))
    final, code = wrapper.settle(own, tmp_path, "S", 0)
    assert code == 0 and final == own
    seen = json.loads((tmp_path / "kvcache_results_S.json").read_text())
    c = seen["summary"]["cache_stats"]
    assert c.get("storage_read_device_p95_ms", 0.0) == 0.0 and c["storage_write_device_p95_ms"] == 3.5
    assert "cpu_read_p50_ms" not in c and c["storage_health"] is None and c["tier_storage_read_bandwidth_gbps"] == 0
    assert seen["mlperf_wrapper"]["left_out_null_percentiles"] == ["cpu_read_p50_ms", "storage_read_device_p95_ms"]
    assert json.loads((tmp_path / "kvtier_result_S.json").read_text()) == kvtier_result  # kvtier's, untouched


def test_no_result_is_no_file_and_an_error(tmp_path: Path):
    assert wrapper.settle(tmp_path / ".missing.json", tmp_path, "S", 2) == (None, 2)
    assert wrapper.settle(tmp_path / ".missing.json", tmp_path, "S", 0) == (None, 1)


@pytest.mark.parametrize(
    "path,system",
    [("/etc", "/etc"), ("/etc/kv_cache", "/etc"), ("/root/kv", "/root"), ("/dev/shm/kv", "/dev"),
     ("/usr/sbin", "/usr/sbin"), ("/usr/lib/x", "/usr"), ("/", "/"), ("/tmp/../etc/x", "/etc"),
     ("/etcd/kv", None), ("/devices", None), ("/usr/local/kv", None), ("/tmp/kv", None), ("/mnt/nvme", None)],
)  # fmt: skip
def test_system_directories_are_whole_path_components(path: str, system: str | None):
    assert system_directory(path) == system


def test_a_link_into_a_system_directory_is_refused(tmp_path: Path):
    (tmp_path / "kv").symlink_to("/etc")
    assert system_directory(tmp_path / "kv" / "cache") == "/etc"


def test_a_folder_another_user_could_change_is_refused_and_nothing_is_written(tmp_path: Path):
    """#58 item 3: the scripts run as whoever runs mlpstorage (root, often); a folder another user owns, or one that
    others (or a group) can write, or under such a parent, let them swap the scripts. A sticky parent (/tmp) is
    fine: others cannot rename what is ours there."""
    from kvtier.errors import ConfigError

    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        write_shim(theirs)
    open_ = tmp_path / "open"
    open_.mkdir()
    open_.chmod(0o777)  # no sticky bit
    with pytest.raises(ConfigError, match=r"writable by others \(mode 777\)"):
        write_shim(open_ / "bin")  # the parent is the problem; the folder is made first, then refused
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o775)
    with pytest.raises(ConfigError, match="writable by its group"):
        write_shim(group)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(ConfigError, match="symbolic link"):
        write_shim(link)
    for folder in (theirs, open_ / "bin", group):
        assert list(folder.iterdir()) == []
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert len(write_shim(sticky / "bin")) == 3


def test_files_already_there_are_replaced_only_with_force_and_kept_as_backups(tmp_path: Path):
    from kvtier.errors import ConfigError

    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.yaml").write_text("# the user's own settings\n")
    with pytest.raises(ConfigError, match=r"already holds config.yaml: give --force"):
        write_shim(folder)
    assert (folder / "config.yaml").read_text() == "# the user's own settings\n"
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml"]
    write_shim(folder, force=True)
    assert (folder / "config.yaml.bak").read_text() == "# the user's own settings\n"
    assert "model_configs" in (folder / "config.yaml").read_text()
    assert (folder / "kv-cache.py").exists() and not (folder / "kv-cache.py.bak").exists()
