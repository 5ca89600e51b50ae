"""Each vLLM profile's dry run against the command lines we expect, and ports chosen free even when
the engines' usual defaults (5555, 8080) are taken."""

from __future__ import annotations

import json
import shlex
import socket
from pathlib import Path

import pytest

from kvtier.config.launch import LaunchConfig
from kvtier.config.replay import ReplayConfig
from kvtier.launch.orchestrate import plan

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def vllm_argv(port: int, tp: int, sidecar: int | None) -> list[str]:
    argv = ["vllm", "serve", MODEL, "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", "0.9"]
    argv += ["--max-model-len", "32768", "--enable-prefix-caching", "--tensor-parallel-size", str(tp)]
    if sidecar is None:
        return argv
    ktc = {
        "kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": sidecar,
            "lmcache.mp.mq_timeout": 300.0,
        },
    }
    return [*argv, "--kv-transfer-config", json.dumps(ktc, separators=(",", ":"))]


def lmcache_argv(port: int, http: int, l1: str, workers: int, l2: dict | None) -> list[str]:
    argv = ["lmcache", "server", "--host", "127.0.0.1", "--port", str(port), "--http-host", "127.0.0.1"]
    argv += ["--http-port", str(http), "--chunk-size", "256", "--l1-size-gb", l1, "--eviction-policy", "LRU"]
    argv += ["--max-workers", str(workers)]
    return argv if l2 is None else [*argv, "--l2-adapter", json.dumps(l2)]


@pytest.mark.parametrize("build", ["nvidia", "amd"])
@pytest.mark.parametrize("tier", ["gpu", "cpu", "nvme"])
def test_each_vllm_profile_dry_run_is_the_expected_command_lines(tmp_path: Path, build: str, tier: str):
    nvme = tmp_path / "nvme"
    cfg = LaunchConfig(
        tier=tier,
        engine="vllm",
        build=build,
        replicas=2,
        gpus="0,1,2,3",
        gpus_per_replica=2,
        l1_gb=16,
        l2_gb=100,
        nvme_dir=str(nvme),
        dry_run=True,
        output=str(tmp_path / "out"),
        replay=ReplayConfig(model=MODEL, dataset="d.jsonl"),
    )
    lp = plan(cfg)
    side, http = lp.ports["sidecar"], lp.ports["sidecar_http"]
    r0, r1 = lp.replica_ports
    lines = [shlex.split(x) for x in lp.lines()]
    var = "CUDA_VISIBLE_DEVICES" if build == "nvidia" else "HIP_VISIBLE_DEVICES"
    # every variable the process gets on top of the inherited ones (DO_NOT_TRACK too): a pasted line is the launch
    env0 = (["env", "-u", "CUDA_VISIBLE_DEVICES", "VLLM_ROCM_USE_AITER=1"] if build == "amd" else []) + [f"{var}=0,1"]
    env1 = (["env", "-u", "CUDA_VISIBLE_DEVICES", "VLLM_ROCM_USE_AITER=1"] if build == "amd" else []) + [f"{var}=2,3"]
    env0, env1 = env0 + ["DO_NOT_TRACK=1"], env1 + ["DO_NOT_TRACK=1"]
    expected = []
    if tier != "gpu":
        l2 = (
            {"type": "fs", "base_path": str(nvme), "use_odirect": True, "max_capacity_gb": 100}
            if tier == "nvme"
            else None
        )
        expected.append(["DO_NOT_TRACK=1", *lmcache_argv(side, http, "16", 4, l2)])
    expected += [
        env0 + vllm_argv(r0, 2, side if tier != "gpu" else None),
        env1 + vllm_argv(r1, 2, side if tier != "gpu" else None),
        ["caddy", "run", "--config", str(tmp_path / "out" / "Caddyfile"), "--adapter", "caddyfile"],
    ]
    assert lines[:-1] == expected
    assert lines[-1][:2] == ["kvtier", "replay"] and f"http://127.0.0.1:{lp.ports['caddy']}/v1" in lines[-1]
    if tier != "gpu":
        assert lp.sidecar is not None and lp.sidecar.health == f"http://127.0.0.1:{http}/healthcheck"
    assert lp.policies() == {
        "kv_load_failure_policy": "recompute" if tier != "gpu" else None,
        "eviction_policy": "LRU" if tier != "gpu" else None,
        "lb_policy": "header X-User-Id" if tier == "gpu" else "least_conn",
    }
    ident = lp.identity(None)
    assert ident["devices"] == {"replica0": ["0", "1"], "replica1": ["2", "3"]}
    assert ident["sizes"]["l1_gb"] == 16 and ident["sizes"]["tensor_parallel_size"] == 2


def test_ports_are_chosen_free_when_the_defaults_are_taken(tmp_path: Path):
    held = []
    for port in (5555, 8080):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        except OSError:
            s.close()  # something else holds it already: taken either way
    try:
        lp = plan(
            LaunchConfig(
                tier="cpu",
                engine="vllm",
                replicas=2,
                gpus="0,1",
                l1_gb=4,
                dry_run=True,
                replay=ReplayConfig(model=MODEL, dataset="d.jsonl"),
            )
        )
        ports = [lp.ports["sidecar"], lp.ports["sidecar_http"], lp.ports["caddy"], *lp.replica_ports]
        assert not {5555, 8080} & set(ports) and len(set(ports)) == len(ports)
        ktc = json.loads(lp.replicas[0].argv[lp.replicas[0].argv.index("--kv-transfer-config") + 1])
        assert ktc["kv_connector_extra_config"]["lmcache.mp.port"] == lp.ports["sidecar"]
        assert lp.sidecar is not None and f"--port {lp.ports['sidecar']} " in shlex.join(lp.sidecar.argv)
    finally:
        for s in held:
            s.close()


def test_default_sizes_come_from_the_host(tmp_path: Path):
    lp = plan(
        LaunchConfig(
            tier="nvme",
            engine="vllm",
            gpus="0",
            nvme_dir=str(tmp_path / "nv"),
            dry_run=True,
            replay=ReplayConfig(model=MODEL, dataset="d.jsonl"),
        )
    )
    z = lp.sizes
    assert 1 <= z["l1_gb"] <= 8 and ("staging cap" in z["l1_source"] or "available" in z["l1_source"])
    assert z["l2_gb"] >= 1 and f"free under {tmp_path}" in z["l2_source"]
    assert not (tmp_path / "nv").exists()
    cpu = plan(
        LaunchConfig(
            tier="cpu", engine="vllm", gpus="0", dry_run=True, replay=ReplayConfig(model=MODEL, dataset="d.jsonl")
        )
    )
    assert cpu.sizes["l2_gb"] is None and "GB available" in cpu.sizes["l1_source"]


def test_an_lmcache_sidecar_is_identified_by_its_healthcheck(tmp_path: Path):
    """A real HTTP server on loopback stands in for LMCache's frontend: healthy passes, anything else
    (another server on the port, an engine not up) is named."""
    import dataclasses
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvtier.launch.running import identify as _identify

    answer = {"body": b'{"status": "healthy"}'}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthcheck" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(answer["body"])

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        lp = plan(
            LaunchConfig(
                tier="cpu",
                engine="vllm",
                gpus="0",
                l1_gb=1,
                dry_run=True,
                replay=ReplayConfig(model=MODEL, dataset="d"),
            )
        )
        assert lp.sidecar is not None
        lp.sidecar = dataclasses.replace(lp.sidecar, health=f"http://127.0.0.1:{srv.server_port}/healthcheck")
        check = _identify(lp, lp.sidecar)
        assert check() is None
        answer["body"] = b'{"status": "unhealthy", "reason": "engine not initialized"}'
        assert "not a healthy LMCache server" in (check() or "")
        answer["body"] = b"<html>someone else</html>"
        assert "failed" in (check() or "")
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_cpu_build_splits_cores_and_sizes_the_kv_cache_from_the_model(tmp_path: Path):
    from kvtier.modelmaker import Geometry, make_model

    model = make_model(tmp_path / "m", Geometry(num_layers=4))  # 2 KiB of KV per token
    cfg = LaunchConfig(tier="gpu", engine="vllm", build="cpu", replicas=2, gpus="0,1,2,3", output=str(tmp_path / "o"),
                       model_dir=str(model), engine_python="/opt/py/bin/python", kv_cache_tokens=8192,
                       max_model_len=4096, replay=ReplayConfig(model="tiny", dataset="d"))  # fmt: skip
    lp = plan(cfg)
    r0, r1 = lp.replicas
    assert r0.argv[:3] == ["/opt/py/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert r0.argv[r0.argv.index("--kv-cache-memory-bytes") + 1] == str(8192 * 2048)
    assert r0.argv[r0.argv.index("--model") + 1] == str(model) and "--load-format" in r0.argv
    assert (r0.env["VLLM_CPU_OMP_THREADS_BIND"], r1.env["VLLM_CPU_OMP_THREADS_BIND"]) == ("0-1", "2-3")
    assert r0.env["OMP_NUM_THREADS"] == "2" and r0.env["CUDA_VISIBLE_DEVICES"] == ""
    assert lp.replay.tokenizer == f"hf:{model}" and lp.sizes["kv_bytes_per_token"] == 2048
    assert lp.devices()["variable"] == "VLLM_CPU_OMP_THREADS_BIND"


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"tier": "cpu", "offload_engine": "lmcache"}, "--offload-engine kvtier or kvtier-shared only"),
        ({"tier": "nvme", "offload_engine": "vllm-native", "nvme_dir": "/x"}, "CPU Offloading is currently only"),
        ({"engine": "sim"}, "a build of vLLM"),
        ({"max_model_len": 32768}, "less one 128-token block"),
    ],
)
def test_the_cpu_build_refuses_what_it_cannot_run(changes: dict, words: str):
    base = {"tier": "gpu", "engine": "vllm", "build": "cpu", "dry_run": True,
            "replay": ReplayConfig(model="tiny", dataset="d")}  # fmt: skip
    with pytest.raises(ValueError, match=words):
        LaunchConfig(**{**base, **changes})


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_the_cpu_builds_offload_tiers_are_kvtiers_spec_inside_vllm(tmp_path: Path, tier: str):
    """--build cpu --tier cpu|nvme: no sidecar; the replica loads kvtier.vllm.spec from a folder linking this kvtier,
    with the tier sizes from --l1-gb (the CPU tier, or the NVMe tier's staging) and --l2-gb."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "hidden_size": 256}))  # fmt: skip
    cfg = LaunchConfig(tier=tier, engine="vllm", build="cpu", engine_python="/e/bin/python", model_dir=str(model),
                       l1_gb=0.25, l2_gb=2, nvme_dir=str(tmp_path / "nvme"), dry_run=True,
                       output=str(tmp_path / "out"), replay=ReplayConfig(model="tiny", dataset="d"))  # fmt: skip
    lp = plan(cfg)
    assert lp.profile_name == f"vllm-cpu-{tier}" and lp.sidecar is None and lp.sizes["offload_engine"] == "kvtier"
    (r0,) = lp.replicas
    assert r0.env["PYTHONPATH"] == str(tmp_path / "out" / "pylib")
    ktc = json.loads(r0.argv[r0.argv.index("--kv-transfer-config") + 1])
    assert ktc["kv_connector"] == "KvtierOffloadingConnector" and ktc["kv_connector_module_path"] == "kvtier.vllm.spec"
    extra = ktc["kv_connector_extra_config"]
    assert extra["spec_name"] == "KvtierOffloadingSpec" and extra["offload"] == tier
    if tier == "cpu":
        assert extra["cpu_offload_gb"] == 0.25
    else:
        assert (extra["staging_gb"], extra["nvme_offload_gb"], extra["nvme_dir"]) == (0.25, 2, str(tmp_path / "nvme"))
    assert lp.policies()["kv_load_failure_policy"] == "recompute" and lp.policies()["eviction_policy"] == "lru"
    assert extra["request_log"] == str(tmp_path / "out" / "replica0.engine-requests.jsonl")
    assert lp.replay.engine_log == [extra["request_log"]]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("engine", ["vllm-native", "kvtier"])
def test_gpu_builds_run_vllms_own_offloading_or_kvtiers_without_a_sidecar(tmp_path: Path, tier: str, engine: str):
    cfg = LaunchConfig(tier=tier, engine="vllm", build="nvidia", offload_engine=engine, gpus="0", l1_gb=16, l2_gb=100,
                       nvme_dir=str(tmp_path / "nvme"), dry_run=True, output=str(tmp_path / "out"),
                       replay=ReplayConfig(model=MODEL, dataset="d.jsonl"))  # fmt: skip
    lp = plan(cfg)
    assert lp.profile_name == f"vllm-nvidia-{tier}-{'native' if engine == 'vllm-native' else 'kvtier'}"
    assert lp.sidecar is None
    (r0,) = lp.replicas
    argv = r0.argv
    if engine == "vllm-native" and tier == "cpu":
        assert argv[-4:] == ["--kv-offloading-backend", "native", "--kv-offloading-size", "16"]
        return
    ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    if engine == "vllm-native":
        assert ktc["kv_connector"] == "OffloadingConnector"
        fs = {"type": "fs", "root_dir": str(tmp_path / "nvme")}
        want = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 16 * 2**30, "secondary_tiers": [fs]}
        assert ktc["kv_connector_extra_config"] == want
    else:
        assert ktc["kv_connector"] == "KvtierOffloadingConnector" and r0.env["PYTHONPATH"].endswith("pylib")


@pytest.mark.parametrize(("offload", "policy"), [("kvtier", "header X-User-Id"), ("vllm-native", "header X-User-Id"),
                                                 ("lmcache", "least_conn"),
                                                 ("kvtier-shared", "least_conn")])  # fmt: skip
def test_replicas_with_their_own_tiers_are_routed_sticky_and_a_shared_sidecar_least_conn(
    tmp_path: Path, offload: str, policy: str
):
    """kvtier's spec and vLLM's native offloading keep each replica's tiers to itself (as its GPU cache): a session
    that moved to another replica would miss them, so auto routing is sticky; LMCache's and kvtier's shared servers
    are not."""
    cfg = LaunchConfig(tier="cpu", engine="vllm", build="nvidia", offload_engine=offload, replicas=2, gpus="0,1",
                       l1_gb=4, dry_run=True, output=str(tmp_path / "out"),
                       replay=ReplayConfig(model=MODEL, dataset="d.jsonl"))  # fmt: skip
    lp = plan(cfg)
    assert lp.policies()["lb_policy"] == policy and f"lb_policy {policy}" in (lp.caddyfile or "")
    forced = plan(cfg.model_copy(update={"lb_policy": "least_conn"}))
    assert forced.policies()["lb_policy"] == "least_conn"


@pytest.mark.parametrize(("build", "tier"), [("cpu", "cpu"), ("cpu", "nvme"), ("nvidia", "nvme"), ("amd", "cpu")])
def test_kvtier_shared_runs_one_cache_server_every_replicas_spec_names(tmp_path: Path, build: str, tier: str):
    """--offload-engine kvtier-shared: one kvtier cache-server sidecar holding the tiers (sized by --l1-gb,
    or --staging-gb and --l2-gb for nvme); every replica's spec names only its socket, and its command parses into
    kvtier's own CacheServerConfig."""
    from kvtier.cli.args import add_config_arguments, config_from_args
    from kvtier.config.sim import CacheServerConfig
    from kvtier.launch.running import identify

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "hidden_size": 256}))  # fmt: skip
    cfg = LaunchConfig(tier=tier, engine="vllm", build=build, offload_engine="kvtier-shared", replicas=2,
                       gpus=None if build == "cpu" else "0,1", engine_python="/e/bin/python", model_dir=str(model),
                       l1_gb=0.5, staging_gb=0.25, l2_gb=2, nvme_dir=str(tmp_path / "nvme"), dry_run=True,
                       output=str(tmp_path / "out"), replay=ReplayConfig(model="tiny", dataset="d"))  # fmt: skip
    lp = plan(cfg)
    suffix = "shared" if build == "cpu" else "kvtier-shared"
    assert lp.profile_name == f"vllm-{build}-{tier}-{suffix}" and lp.sidecar is not None
    sock = str(lp.sockdir / "cache.sock")
    logs = []
    for r in lp.replicas:
        extra = json.loads(r.argv[r.argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        logs.append(extra.pop("request_log"))
        assert extra == {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm.spec",
                         "cache_server": sock}  # fmt: skip
    # each replica its own per-request log, and the replay joins them all
    out = tmp_path / "out"
    assert logs == [str(out / "replica0.engine-requests.jsonl"), str(out / "replica1.engine-requests.jsonl")]
    assert lp.replay.engine_log == logs
    argv = lp.sidecar.argv
    assert argv[:2] == ["kvtier", "cache-server"]
    import argparse

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, CacheServerConfig)
    server = config_from_args(parser.parse_args(argv[2:]), CacheServerConfig)
    assert server.socket == sock and server.offload == tier
    if tier == "cpu":
        assert server.cpu_offload_gb == 0.5
    else:
        assert (server.staging_gb, server.nvme_offload_gb, server.nvme_dir) == (0.25, 2, str(tmp_path / "nvme"))
    assert lp.policies()["lb_policy"] == "least_conn"
    # the sidecar is identified as this run's kvtier server (its health names its socket), not as an LMCache one
    import dataclasses

    from kvtier.vllm.blockserver import BlockServer
    from kvtier.vllm.settings import VllmOffloadSettings

    lp.sockdir.mkdir(mode=0o700)
    servers = [BlockServer(VllmOffloadSettings(), sock), BlockServer(VllmOffloadSettings(), str(lp.sockdir / "x.sock"))]
    try:
        for srv, verdict in zip(servers, [None, "not this run's kvtier cache-server"], strict=True):
            lp.sidecar = dataclasses.replace(lp.sidecar, health=f"http://127.0.0.1:{srv.start()}/health")
            found = identify(lp, lp.sidecar)()
            assert found is None if verdict is None else verdict in (found or ""), found
    finally:
        for srv in servers:
            srv.close()
        lp.sockdir.rmdir()


def test_a_dry_run_on_a_host_without_gpus_or_nvme_dir_plans_with_placeholders_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """docs/serving.md's dry-run example once failed here (--nvme-dir, then no GPUs, exit 6): a dry run plans with
    placeholders and names each; a real run still refuses both."""
    from kvtier.errors import LaunchError

    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi / rocm-smi: this host offers no device
    base = {"tier": "nvme", "engine": "vllm", "build": "amd", "replicas": 2, "output": str(tmp_path / "out"),
            "replay": ReplayConfig(model=MODEL, dataset="d")}  # fmt: skip
    lp = plan(LaunchConfig(**base, dry_run=True))
    assert [r.devices for r in lp.replicas] == [("GPU0",), ("GPU1",)]
    assert len(lp.assumed) == 2 and "--nvme-dir" in lp.assumed[0] and "GPU0,GPU1" in lp.assumed[1]
    with pytest.raises(ValueError, match="--nvme-dir: required"):
        LaunchConfig(**base)
    with pytest.raises(LaunchError, match="need 2 device"):
        plan(LaunchConfig(**base, nvme_dir=str(tmp_path)))
    assert plan(LaunchConfig(**base, nvme_dir=str(tmp_path), gpus="0,1", dry_run=True)).assumed == []


@pytest.mark.parametrize("given", [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": ""}, {"gpus": "0"}])
def test_a_dry_run_never_overrides_an_allocation_the_user_gave(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given):
    """#58 item 15: with CUDA_VISIBLE_DEVICES=0 (or an empty one, or --gpus 0) and --replicas 2, a dry run assumed
    "GPU0,GPU1" and planned; the devices the user gave are the devices, so it refuses as a real run does."""
    from kvtier.errors import LaunchError

    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    for k, v in given.items():
        if k.isupper():
            monkeypatch.setenv(k, v)
    gpus = {"gpus": given["gpus"]} if "gpus" in given else {}
    cfg = LaunchConfig(tier="cpu", engine="vllm", build="nvidia", replicas=2, output=str(tmp_path / "out"),
                       replay=ReplayConfig(model=MODEL, dataset="d"), dry_run=True, **gpus)  # fmt: skip
    with pytest.raises(LaunchError, match="need 2 device"):
        plan(cfg)
