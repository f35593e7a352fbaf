"""What the simulated cluster is made of, and the timed events that disturb it.

Every quantity carries its unit in its name; every field is validated on
construction, so an impossible cluster cannot exist.
"""

from __future__ import annotations


import attrs

from .._validate import non_negative_int as _nonneg_int
from .._validate import non_negative_number as _nonneg
from .._validate import positive_int as _pos_int
from .._validate import positive_number as _pos
from .._validate import probability as _prob
from ..errors import ConfigError
from ..profile import PrefillModel

ROUTERS = ("random", "round-robin", "least-loaded", "prefix-affinity", "kv-overlap")


@attrs.frozen
class ClusterConfig:
    """Replicas, the shared pool and the network — the physics, equal for every policy set."""

    bytes_per_token: int = attrs.field(validator=_pos_int)
    prefill: PrefillModel
    replicas: int = attrs.field(default=8, validator=_pos_int)
    #: C_effective of each replica's local KV cache (physical − reserved − fragmentation);
    #: active decodes are modelled explicitly as pins, so they are not subtracted here
    local_capacity_bytes: int = attrs.field(default=28 * 2**30, validator=_nonneg_int)
    prefill_slots: int = attrs.field(default=1, validator=_pos_int)
    decode_tokens_per_s: float = attrs.field(default=30.0, validator=_pos)
    storage_nodes: int = attrs.field(default=4, validator=_pos_int)
    pool_capacity_bytes_per_node: int = attrs.field(default=512 * 2**30, validator=_nonneg_int)
    #: useful bandwidth of each storage node's link and of each replica's NIC (0 = no path)
    #: (default 40 Gbit/s: what a 100 Gbit/s NIC typically delivers over TCP — useful, not nominal)
    node_bandwidth_bytes_per_s: float = attrs.field(default=5e9, validator=_nonneg)
    replica_bandwidth_bytes_per_s: float = attrs.field(default=5e9, validator=_nonneg)
    #: the pool stripes chains over its nodes in chunks of this many blocks (placed by the chunk's first key)
    placement_chunk_blocks: int = attrs.field(default=8, validator=_pos_int)
    #: the copy through CPU memory when the path is not direct (None: direct path)
    stage_bytes_per_s: float | None = None
    lookup_s: float = attrs.field(default=0.0005, validator=_nonneg)
    transfer_overhead_s: float = attrs.field(default=0.0002, validator=_nonneg)
    install_s_per_block: float = attrs.field(default=2e-5, validator=_nonneg)
    dispatch_s: float = attrs.field(default=0.002, validator=_nonneg)
    #: seconds of GPU time a load steals per byte moved (paid by the next prefill and by every active decode)
    interference_s_per_byte: float = attrs.field(default=0.5e-3 / 1e9, validator=_nonneg)
    #: probability that a transfer fails (outside degradation windows)
    failure_rate: float = attrs.field(default=0.0, validator=_prob)
    #: probability that a transfer hangs (no answer) until the transport timeout or the policy's own timeout
    timeout_rate: float = attrs.field(default=0.0, validator=_prob)
    #: the transport's own hard timeout: a transfer longer than this fails as a timeout
    transport_timeout_s: float = attrs.field(default=30.0, validator=_pos)
    router: str = "round-robin"
    affinity_blocks: int = attrs.field(default=4, validator=_pos_int)
    #: kv-overlap router: cost = prefill tokens needed + queued prefill tokens + decode_weight × active decode tokens
    decode_weight: float = attrs.field(default=0.05, validator=_nonneg)
    #: a new replica counts as warming for at most this long (or until its warmup plan says it is ready)
    warmup_window_s: float = attrs.field(default=60.0, validator=_pos)
    #: how publishes share links with loads: "fair" (default: what engines do — their background
    #: writes are ordinary flows that share the links) or "background" (a lower class that only uses
    #: what loads leave, as with a QoS/traffic class for write-back). Reads and writes meet only on the
    #: staging copy through CPU memory (``stage_bytes_per_s``): a full-duplex NIC carries them apart. So
    #: "background" needs ``stage_bytes_per_s``; without it the setting could change nothing, and is refused
    publish_priority: str = "fair"
    #: the replicas' real prefill over ``prefill`` (the profile, which is also the admission controller's prior):
    #: 1.0 the profile is right; 2.0 the GPUs run twice as slow as profiled (another GPU model, throttling, a noisy
    #: neighbour); 0.5 twice as fast. kvpolicy's controller learns the ratio from the prefills it observes
    compute_factor: float = attrs.field(default=1.0, validator=_pos)
    #: kvpolicy's controller's prior for the path's bandwidth over the real one: 1.0 it is told the link as it is;
    #: 4.0 it believes the link 4x faster than it is (a NIC's spec, a benchmark on an idle fabric); 0.25 4x slower.
    #: It learns B_eff from the transfers it observes (only from those it admits)
    link_prior_factor: float = attrs.field(default=1.0, validator=_pos)

    def __attrs_post_init__(self) -> None:
        if self.publish_priority not in ("fair", "background"):
            raise ConfigError("publish_priority", f"must be 'fair' or 'background', got {self.publish_priority!r}")
        if self.router not in ROUTERS:
            raise ConfigError("router", f"must be one of {ROUTERS}, got {self.router!r}")
        if self.stage_bytes_per_s is not None:
            _pos(self, attrs.fields(ClusterConfig).stage_bytes_per_s, self.stage_bytes_per_s)
        if self.publish_priority == "background" and self.stage_bytes_per_s is None:
            raise ConfigError("publish_priority", "'background' needs stage_bytes_per_s: without a staging copy reads and writes "
                              "never share a link (full-duplex ports), so it would change nothing")
        if not isinstance(self.prefill, PrefillModel):
            raise ConfigError("prefill", "must be a PrefillModel (e.g. read_profile(path).prefill_model())")

    def block_bytes(self, block_size_tokens: int) -> int:
        return self.bytes_per_token * block_size_tokens

    def prefill_s(self, start_tokens: int, end_tokens: int) -> float:
        """GPU seconds to prefill tokens [start, end) with [0, start) cached: fixed term + marginal
        + reading the cached prefix (the profile's local-hit slope; 0 unless measured), × ``compute_factor``."""
        return self.compute_factor * float(self.prefill.prefill_s(start_tokens, end_tokens))

    @property
    def prefill_a_s(self) -> float:
        """The fixed term of a real prefill (the profile's, × ``compute_factor``)."""
        return self.compute_factor * self.prefill.a_s


@attrs.frozen
class ScaleOut:
    """``replicas`` new, empty replicas join at ``t_s``."""

    t_s: float = attrs.field(validator=_nonneg)
    replicas: int = attrs.field(validator=_pos_int)


@attrs.frozen
class Degrade:
    """Storage node ``node`` runs at ``bandwidth_factor`` × its bandwidth and fails transfers
    with probability ``failure_rate`` from ``t1_s`` to ``t2_s``."""

    node: int = attrs.field(validator=_nonneg_int)
    t1_s: float = attrs.field(validator=_nonneg)
    t2_s: float = attrs.field(validator=_nonneg)
    bandwidth_factor: float = attrs.field(default=0.1, validator=_pos)
    failure_rate: float = attrs.field(default=0.2, validator=_prob)

    def __attrs_post_init__(self) -> None:
        if self.t2_s <= self.t1_s:
            raise ConfigError("t2_s", f"must be after t1_s ({self.t1_s}), got {self.t2_s}")


@attrs.frozen
class Spike:
    """Arrival rate × ``factor`` from ``t1_s`` to ``t2_s`` (later requests are pulled forward;
    none is added or dropped)."""

    t1_s: float = attrs.field(validator=_nonneg)
    t2_s: float = attrs.field(validator=_nonneg)
    factor: float = attrs.field(default=4.0, validator=_pos)

    def __attrs_post_init__(self) -> None:
        if self.t2_s <= self.t1_s:
            raise ConfigError("t2_s", f"must be after t1_s ({self.t1_s}), got {self.t2_s}")
