"""Group voting: every rank agrees on each step before its forward, so collectives never part.

Each attention data-parallel rank schedules its own requests, so ranks differ in how much work a
step has, and a rank may have none. The expert exchange is a collective per MoE layer per forward
pass, so before its forward every rank shares, in one ``all_reduce``::

    tokens        its scheduled tokens           MAX  (0 everywhere: nobody runs a forward)
    is_prefill    any prompt chunk in its batch  MAX  "any triggers"
    can_use_graph its batch fits a decode graph  MIN  "all must agree" (sent negated, under MAX)
    passes        forward passes it will run     MAX  (a state-replay pass + the step's own)
    stop          it was told to shut down       MAX
    rebalance     it was asked to re-place       MAX

and, when the vote chose graphs, a second round (MIN) in which each rank confirms it can replay
one for the agreed mode; one refusal and every rank runs eager. A rank then runs as many empty
passes (every MoE layer's exchange with no tokens, :func:`~.experts.empty_pass`) as it is short
of the group's ``passes``: the expert collectives stay aligned layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .experts import MoELayer, empty_pass

__all__ = ["Lockstep", "StepDecision", "StepVote", "vote"]


@dataclass(frozen=True)
class StepVote:
    tokens: int
    is_prefill: bool
    can_use_graph: bool
    passes: int
    stop: bool = False
    rebalance: bool = False


@dataclass(frozen=True)
class StepDecision:
    max_tokens: int  # the busiest rank's tokens; 0: no forward anywhere this step
    any_prefill: bool
    use_graph: bool
    passes: int
    stop: bool
    rebalance: bool


def vote(mine: StepVote, device: torch.device, graph_ready=None, group=None) -> StepDecision:
    """The group's decision (collective: every rank calls it once per step). ``graph_ready``:
    called when the first round chose graphs, returns whether this rank can replay one."""
    packed = torch.tensor(
        [mine.tokens, mine.is_prefill, -int(mine.can_use_graph), mine.passes, mine.stop, mine.rebalance],
        dtype=torch.int64,
        device=device,
    )
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    tokens, prefill, neg_graph, passes, stop, rebalance = packed.tolist()
    use_graph = neg_graph == -1 and not prefill
    if use_graph:  # the second round: everyone confirms the agreed mode, or all run eager
        ok = torch.tensor([bool(graph_ready()) if graph_ready is not None else False], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        use_graph = bool(ok.item())
    return StepDecision(tokens, bool(prefill), use_graph, passes, bool(stop), bool(rebalance))


class Lockstep:
    """What an engine that is one rank of a group runs before each forward (``LLMEngine.lockstep``):
    the vote, then the empty passes that bring it level with the busiest rank."""

    def __init__(
        self, layers: list[MoELayer], device: torch.device, dtype: torch.dtype, group=None, solo: bool = False
    ) -> None:
        """``solo``: the ranks share no collective (data parallelism alone, every rank a whole
        model): each decides its steps alone, nobody waits for a slower rank."""
        self.layers, self.device, self.dtype, self.group, self.solo = layers, device, dtype, group, solo
        self.want_stop = False
        self.want_rebalance = False
        self.decision: StepDecision | None = None
        self.broken: BaseException | None = None  # the collective error that broke the group
        self.steps = 0  # steps in which some rank ran a forward
        self.busy_steps = 0  # ... and this one had tokens of its own
        self.empty_passes = 0

    def align(self, sched, replay) -> None:
        passes = (1 if sched.requests else 0) + (1 if replay is not None else 0)
        prefill = any(len(s.token_ids) > 1 or not s.sample for s in sched.requests)
        mine = StepVote(sched.num_tokens, prefill, False, passes, self.want_stop, self.want_rebalance)
        if self.solo:
            self.decision = StepDecision(mine.tokens, prefill, False, passes, mine.stop, mine.rebalance)
            self.steps += bool(sched.num_tokens)
            self.busy_steps += bool(sched.num_tokens)
            return
        try:
            self.decision = decision = vote(mine, self.device, group=self.group)
            for _ in range(decision.passes - passes):
                empty_pass(self.layers, self.dtype, self.device)
                self.empty_passes += 1
        except BaseException as exc:
            self.broken = exc
            raise
        if decision.max_tokens:
            self.steps += 1
            self.busy_steps += bool(sched.num_tokens)
