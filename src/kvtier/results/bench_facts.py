"""The sections of a bench result about where it ran rather than what it measured (bench/facts.py builds
them): the offered load's facts, the bytes the kernel and the devices saw, memory against its bound, the
storage tier and its payload, the workload's source, the I/O trace, block-layer latency tracing, GPU
telemetry and the validation against a trace. docs/metrics.md defines every field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvtier.results.envelope import Section


class ReadWrite(Section):
    write: int
    read: int


class ProcessIO(Section):
    storage_tier_bytes_written_on_disk: int
    storage_tier_bytes_read_on_disk: int
    cancelled_ops: ReadWrite
    cancelled_bytes: ReadWrite
    process_write_bytes: int
    process_read_bytes: int
    write_ratio: float | None
    read_ratio: float | None


class MemoryStats(Section):
    peak_rss_bytes: int
    bound_bytes: int
    noise_buffer_bytes: int
    io_slots: int
    io_chunk_bytes: int
    cpu_tier_capacity_bytes: int
    writer_buffer_bytes: int | None = None  # the noise held by the writers' buffers (storage.payload); null: older
    within_bound: bool


class GdsChoice(Section):
    """--gds: what it resolved to and, where the GDS tier ran, kvikio's account of the payload's path."""

    requested: Literal["auto", "on", "off"]
    used: bool  # the probe's answer, replaced by the evidence's where the GDS tier ran
    reason: str
    evidence: str | None = None  # "kvikio statistics" (bytes per backend) or its compatibility mode
    gds_bytes: int | None = None  # kvikio's cuFile backend: bytes moved (null without its statistics)
    posix_bytes: int | None = None  # kvikio's POSIX backend (its compatibility mode): bytes moved
    staged_bytes: int | None = None  # payload moved through the tier's device buffers, writes and reads
    device_bytes: int | None = None  # --gpu-native: payload between the file and device memory with no staging copy


class PayloadSampleStats(Section):
    blocks_sampled: int
    distinct_blocks: int
    distinct_fraction: float | None
    compress_codec: str | None
    compress_sample_bytes: int
    compress_ratio: float | None


class PayloadFacts(Section):
    """What was written: the scheme that makes every 4 KiB block unique, and the run's own sample of it."""

    scheme: str
    payload: str
    noise_bytes: int
    stamp_bytes_per_block: int
    block_bytes: int
    # how the bytes were made (null in results from before stamping in place): entry bytes handed out from
    # writers' buffers with only their stamps rewritten, entry bytes copied from the noise (a memory tier's one
    # copy; of them, those a helper thread copied, the second half of a write that had the tier to itself), the
    # writers' buffers made and the bytes of noise they hold
    bytes_stamped_in_place: int | None = None
    bytes_copied: int | None = None
    bytes_copied_by_helper: int | None = None
    writer_buffers: int | None = None
    writer_buffer_bytes: int | None = None
    sample: PayloadSampleStats


class DeviceSource(Section):
    """--gpu-native: how the entries were made in device memory (engine/device.py DeviceNoise)."""

    scheme: str
    device_noise_bytes: int
    writer_buffers: int
    writer_buffer_bytes: int
    bytes_stamped_on_device: int


class GpuNative(Section):
    """--gpu-native: the device the KV started and ended in, and every byte's path between it and the tiers:
    ``paths.write[tier][path]`` (from device memory / through the pinned host buffer / from host memory) and
    ``paths.read[tier][path]`` (device to device / host to device), in bytes."""

    device: str
    stand_in: bool  # torch CPU tensors standing in for a GPU (tests): no GPU moved these bytes
    pinned_bounce: bool  # the bounce buffers were page-locked (cudaHostRegister succeeded)
    source: DeviceSource
    paths: dict[str, dict[str, dict[str, int]]]


class StorageFacts(Section):
    cache_dir: str
    run_dir: str | None
    direct_io: bool
    direct_io_supported: bool
    capacity_bytes: int
    detected_free_bytes: int
    tier_order: list[str] = Field(default_factory=list)  # the waterfall, fastest first (empty: older results)
    gds: GdsChoice | None = None  # --gds: requested, used, reason
    remote_tiers: dict[str, dict[str, Any]] = Field(default_factory=dict)  # Redis/S3: the server as found at start
    payload: PayloadFacts | None = None  # the data written and the check of its own sample (engine/noise.py)
    gpu_native: GpuNative | None = None  # --gpu-native: the device, and the path every byte took


class SyntheticSource(Section):
    kind: Literal["synthetic"] = "synthetic"
    profiles: list[str]


class TraceSource(Section):
    kind: Literal["trace"] = "trace"
    format: str
    files: list[str]
    requests: int
    skipped_rows: int
    block_tokens: int | None


class DatasetSource(Section):
    kind: Literal["dataset"] = "dataset"
    format: Literal["sharegpt"] = "sharegpt"
    path: str
    conversations: int
    turns: int
    tokenizer: str
    skipped_records: int


class IOTraceSource(Section):
    """kvtier trace replay: the I/O trace whose rows this run did (iotrace/replay.py)."""

    kind: Literal["io-trace"] = "io-trace"
    path: str
    rows: int
    rows_skipped: int
    duration_s: float
    speed: float
    workers: int
    tier_map: dict[str, str]
    missing_reads: int  # reads of objects the trace never wrote (or that were dropped): no I/O
    unknown_objects_written: int  # demotions of objects the trace never wrote: written where they land
    moves_not_made: int
    dropped_objects: int  # deleted to make room (bottom-tier deletions have no rows)
    rows_not_done: int


WorkloadSource = Annotated[SyntheticSource | TraceSource | DatasetSource | IOTraceSource, Field(discriminator="kind")]


class DeviceStats(Section):
    """The devices under the storage tier, from /proc/diskstats (telemetry/diskstats.py)."""

    path: str
    resolution: str
    devices: list[str]
    interval_s: float | None = None
    totals: dict[str, Any] | None
    timeline: list[dict[str, Any]]
    ours: dict[str, int] | None
    other_traffic_fraction: dict[str, float | None] | None
    sampler_cpu_seconds: float | None = None
    sampler_cpu_fraction: float | None = None


class IOTraceStats(Section):
    """--io-trace-log: the trace file this run wrote instead of moving bytes (tracefile.py)."""

    path: str
    rows: int
    rows_dropped: int
    compressed: bool
    csv_bytes: int
    file_bytes: int
    error: str | None
    rows_per_sec: float | None  # rows / load seconds: the trace mode's own speed
    by_tier_op: dict[str, int]  # "Tier-2 Write": rows


class LatencyTracing(Section):
    """--enable-latency-tracing: bpftrace's histograms of the latency stack (telemetry/blocktrace.py)."""

    devices: list[str]
    traced: bool
    reason: str | None  # why not traced (None when traced)
    histograms: dict[str, Any]  # name -> count, p50/p95/p99 buckets, buckets; times in us, sizes in KiB
    processes: str | None = None  # whose system calls were traced (a bpftrace predicate); None: block layer only
    degraded: str | None = None  # why the system-call probes are not in the trace, when they are not
    duration_s: float | None = None  # how long bpftrace traced
    empty: list[str] = Field(default_factory=list)  # histograms traced but with no event (e.g. no read reached it)
    unavailable: dict[str, str] = Field(default_factory=dict)  # the spec's figures no tracepoint gives, and why


class ValidationStats(Section):
    """--validation-trace: the run's request sizes and arrivals against a real trace (bench/validation.py)."""

    trace: str
    format: str
    trace_requests: int
    run_requests: int
    distributions: dict[str, dict[str, Any]]  # input_tokens, output_tokens, inter_arrival_s
    max_ks: float | None


class GpuTelemetry(Section):
    """NVML over the load (telemetry/gpu.py): per GPU power, utilisation, memory; or why none."""

    available: bool
    code: str | None  # nvml-not-installed | nvml-unavailable | no-nvidia-device (None when available)
    reason: str | None
    interval_s: float
    gpus: list[dict[str, Any]]
    timeline: list[dict[str, Any]]


class LoadFacts(Section):
    """How the load was offered (bench/runner.py): the reference's open arrival or closed loop, the workers,
    what --max-concurrent-allocs bounded, and what the bounded queue did."""

    arrival: str
    workers: int
    alloc_bound: str
    max_concurrent_allocs: int
    max_queued: int
    requests_dropped: int  # open arrival: found --max-queued requests waiting, never served
    requests_dropped_bytes: int  # the KV bytes they would have read and written
    queue_depth_max: int
    queue_depth_mean: float | None
    queue_depth_timeline: list[dict[str, float]]
    alloc_wait_s: float  # summed over requests: time waiting for a write slot (outside storage time)
