"""Where a worker sits in its engine's parallel layout, and what that means for the transfer.

Per-rank endpoints: every worker runs its own aiolayer runtime. With ``control_port`` = B (not 0),
the worker of data-parallel rank ``dp`` and tensor-parallel rank ``tp`` binds ``B + dp * TP + tp``
(TP = the engine's tensor-parallel size), and its engine id is ``<engine_id>-dp<dp>-tp<tp>`` when the
engine has more than one rank. ``control_port`` 0 = any free port; D's ranks then tell the proxy
theirs in their registration, and P's must still be given (the proxy reaches P by the rule above).

Transfer ids: the proxy mints one per request; D's tensor-parallel rank ``d`` of ``n > 1`` registers
it as ``<id>.d<d>`` so that one P rank can hold the sends to several D ranks of one request.

Head slices: which P rank writes which heads into which D rank is ``aiolayer.protocol.plan.map_ranks``
of the model's KV heads and both TP sizes (GQA replication and MLA included). Pipeline parallelism
is refused at start: its stages hold different layers, which the protocol does not map.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from aiolayer.errors import ConfigError
from aiolayer.protocol.plan import RankRoute, local_heads, map_ranks


@dataclass(frozen=True)
class Topology:
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    total_kv_heads: int = 1     # the model's KV heads before any split
    mla: bool = False           # one latent plane per layer, replicated on every rank

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.dp_rank < self.dp_size):
            raise ConfigError(f"rank (dp {self.dp_rank}, tp {self.tp_rank}) outside sizes "
                              f"(dp {self.dp_size}, tp {self.tp_size})")
        try:
            local_heads(self.total_kv_heads, self.tp_size, self.mla)
        except ValueError as exc:
            raise ConfigError(f"KV heads over tensor-parallel ranks: {exc}") from None

    @property
    def ranks(self) -> int:
        return self.tp_size * self.dp_size

    def control_port(self, base: int) -> int:
        """This worker's control port by the documented rule (0 stays 0: any free port)."""
        return base + self.dp_rank * self.tp_size + self.tp_rank if base else 0

    def engine_id(self, base: str) -> str:
        return base if self.ranks == 1 else f"{base}-dp{self.dp_rank}-tp{self.tp_rank}"

    def local_heads(self) -> int:
        return local_heads(self.total_kv_heads, self.tp_size, self.mla)


def from_vllm(vllm_config) -> Topology:
    """The running worker's topology (call it in a worker process, once vLLM set up its groups)."""
    from vllm.distributed import parallel_state

    par, model = vllm_config.parallel_config, vllm_config.model_config
    if par.pipeline_parallel_size > 1:
        raise ConfigError(f"pipeline_parallel_size {par.pipeline_parallel_size}: aiolayer maps tensor and data "
                          "parallel ranks, not pipeline stages (each holds other layers); run P and D without PP")
    if parallel_state.model_parallel_is_initialized():
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    elif par.tensor_parallel_size == 1:
        tp_rank = 0   # a worker built outside vLLM's process groups (in-process tests)
    else:
        raise ConfigError("tensor_parallel_size > 1 but vLLM's model-parallel groups are not set up yet")
    # vLLM runs each DP rank of a dense (non-MoE) model as an independent engine: it resets
    # data_parallel_rank/size to 0/1 there and keeps the rank in data_parallel_index
    dp_rank = getattr(par, "data_parallel_index", None)
    dp_rank = par.data_parallel_rank if dp_rank is None else dp_rank
    return Topology(tp_rank=tp_rank, tp_size=par.tensor_parallel_size,
                    dp_rank=dp_rank, dp_size=max(par.data_parallel_size, dp_rank + 1),
                    total_kv_heads=model.get_total_num_kv_heads(), mla=bool(model.use_mla))


def rank_transfer_id(transfer_id: str, d_rank: int, d_tp: int) -> str:
    """The id D's rank ``d_rank`` of ``d_tp`` registers the request's transfer under."""
    return transfer_id if d_tp == 1 else f"{transfer_id}.d{d_rank}"


@functools.lru_cache(maxsize=64)   # asked per request; the answer depends on the sizes only
def _routes(total_kv_heads: int, p_tp: int, d_tp: int, mla: bool) -> tuple[RankRoute, ...]:
    try:
        return tuple(map_ranks(total_kv_heads, p_tp, d_tp, mla))
    except ValueError as exc:
        raise ConfigError(f"P tp={p_tp} -> D tp={d_tp}: {exc}") from None


def routes_for_p(topo: Topology, d_tp: int) -> list[RankRoute]:
    """The routes this P rank writes, into D ranks of tensor-parallel size ``d_tp``."""
    routes = _routes(topo.total_kv_heads, topo.tp_size, d_tp, topo.mla)
    mine = [r for r in routes if r.p_rank == topo.tp_rank]
    if len({r.d_rank for r in mine}) != len(mine):   # one spec per (transfer id, D rank)
        raise ConfigError(f"P tp={topo.tp_size} -> D tp={d_tp}: rank {topo.tp_rank} would write two "
                          "separate head ranges into one D rank, which one transfer cannot carry")
    return mine


def writers_into(topo: Topology, d_tp: int, d_rank: int) -> int:
    """How many P ranks (this P's TP size) write into D rank ``d_rank`` of ``d_tp``: said in P's layout
    request, so that a D registered for another number refuses the plan (P's and D's views disagree)."""
    routes = _routes(topo.total_kv_heads, topo.tp_size, d_tp, topo.mla)
    return len({r.p_rank for r in routes if r.d_rank == d_rank})


def writers_of_d(topo: Topology, p_tp: int) -> list[int]:
    """The P ranks (of ``p_tp``) that write into this D rank: each must report before it finishes."""
    routes = _routes(topo.total_kv_heads, p_tp, topo.tp_size, topo.mla)
    return sorted({r.p_rank for r in routes if r.d_rank == topo.tp_rank})


def whole_blocks(route: RankRoute, topo: Topology, d_tp: int) -> bool:
    """The route copies every head of a block on both sides: a plain block copy, no geometry needed."""
    if topo.mla:
        return True
    d_heads = local_heads(topo.total_kv_heads, d_tp)
    return route.src_head == route.dst_head == 0 and route.num_heads == topo.local_heads() == d_heads


def refused_d_ranks(topo: Topology, planned_p_tp: int, d_tp: int) -> list[int]:
    """The D ranks waiting for this P rank's word under a plan made for a P of ``planned_p_tp`` ranks
    (another size than ours): each must hear FAILED from us, so that it fails now rather than at its
    deadline. None for a rank the plan does not have; every D rank where that plan maps nothing."""
    if topo.tp_rank >= planned_p_tp:
        return []
    try:
        routes = _routes(topo.total_kv_heads, planned_p_tp, d_tp, topo.mla)
    except ConfigError:
        return list(range(d_tp))
    return sorted({r.d_rank for r in routes if r.p_rank == topo.tp_rank})
