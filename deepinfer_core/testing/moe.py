"""Conformance suite for MoE dispatchers (``deepinfer_moe_dispatcher``).

Subclass :class:`MoEDispatcherSuite` and override the ``dispatcher`` and ``platform`` fixtures
(``dispatcher`` may ask for the ``spec`` fixture). What runs follows what the dispatcher claims:
its ``capabilities`` (:class:`~deepinfer_core.moe.MoECapabilities`; a dispatcher that declares
none is held to the previous contract: the learned scorings, no hash routing). A case it does
not claim is skipped with the reason; ``supported_scorings`` narrows further if needed.

Routing is checked against scores computed here from the definitions (softmax, sigmoid,
sqrt(softplus), the hash table), and ``forward`` against :func:`naive_moe`, a per-token,
per-choice loop that shares nothing with any dispatcher's permute / grouped-GEMM path. Where
transformers' DeepSeek-V4 modules import, the V4 routers (learned ``sqrtsoftplus`` with a
correction bias, and hash) and the clamped-SwiGLU experts are also checked against them.
"""

from __future__ import annotations

import pytest
import torch

from ..moe import ExpertWeights, MoEDispatcher, MoESpec, moe_capabilities
from .platform import usable_device

__all__ = ["MoEDispatcherSuite", "naive_moe", "reference_scores"]


def reference_scores(scoring: str, logits: torch.Tensor) -> torch.Tensor:
    """Routing scores straight from their definitions, in float64."""
    x = logits.double()
    if scoring == "softmax":
        e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
        return e / e.sum(dim=-1, keepdim=True)
    if scoring == "sigmoid":
        return 1.0 / (1.0 + torch.exp(-x))
    if scoring == "sqrtsoftplus":
        return torch.log1p(torch.exp(x)).sqrt()
    raise ValueError(scoring)


def _by_expert(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each token's choices by expert id, so that two routings compare pair by pair."""
    ids, order = ids.cpu().long().sort(dim=-1)
    return ids, weights.cpu().double().gather(1, order)


def _hf_v4(spec: MoESpec, vocab: int):
    """transformers' DeepSeek-V4 modeling module and a config matching ``spec``."""
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    config = modeling.DeepseekV4Config(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        moe_intermediate_size=spec.intermediate_size,
        n_routed_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        num_hidden_layers=1,
        routed_scaling_factor=spec.routed_scaling,
        swiglu_limit=spec.swiglu_limit or 10.0,
    )
    config._experts_implementation = "eager"  # the per-expert loop; standalone modules have none set
    return modeling, config


def naive_moe(spec: MoESpec, hidden, topk_ids, topk_weights, experts: ExpertWeights) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * down_e(act(gate_e x) * up_e x), token by token, in float64."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    inter = spec.intermediate_size
    for t in range(hidden.shape[0]):
        x = hidden[t].double().cpu()
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            w_gate = experts.gate_up[e, :inter].double().cpu()
            w_up = experts.gate_up[e, inter:].double().cpu()
            gate, up = w_gate @ x, w_up @ x
            if spec.swiglu_limit is not None:
                gate = torch.clamp(gate, max=spec.swiglu_limit)
                up = torch.clamp(up, -spec.swiglu_limit, spec.swiglu_limit)
            act = gate / (1.0 + torch.exp(-gate))  # silu
            out[t] += float(topk_weights[t, j]) * (experts.down[e].double().cpu() @ (act * up))
    return out


class MoEDispatcherSuite:
    """What every :class:`~deepinfer_core.moe.MoEDispatcher` must do."""

    # Narrow in a subclass to test fewer rules than the dispatcher claims; "hash" covers the
    # DeepSeek-V4 hash-layer cases. What the dispatcher does not claim is skipped anyway.
    supported_scorings: tuple[str, ...] = ("softmax", "sigmoid", "sqrtsoftplus", "hash")
    dtype: torch.dtype = torch.float32
    atol: float = 1e-4
    rtol: float = 1e-4

    def pytest_generate_tests(self, metafunc) -> None:
        if "scoring" in metafunc.fixturenames:
            metafunc.parametrize("scoring", [s for s in self.supported_scorings if s != "hash"])

    @pytest.fixture
    def platform(self):
        pytest.fail("a MoEDispatcherSuite subclass must override the `platform` fixture")

    @pytest.fixture
    def dispatcher(self, spec, platform) -> MoEDispatcher:
        pytest.fail("a MoEDispatcherSuite subclass must override the `dispatcher` fixture")

    @pytest.fixture
    def spec(self) -> MoESpec:
        # The spec the dispatcher fixture is built for; tests vary it with dataclasses.replace.
        return MoESpec(layer_index=0, num_experts=16, top_k=4, hidden_size=32, intermediate_size=24, scoring="softmax")

    @pytest.fixture
    def device(self, platform) -> torch.device:
        return usable_device(platform)

    def logits(self, spec: MoESpec, device, tokens: int = 24, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(tokens, spec.num_experts, generator=g).to(device)

    def experts(self, spec: MoESpec, device, seed: int = 1) -> ExpertWeights:
        g = torch.Generator().manual_seed(seed)
        e, i, d = spec.num_experts, spec.intermediate_size, spec.hidden_size
        gate_up = torch.randn(e, 2 * i, d, generator=g) / d**0.5
        down = torch.randn(e, d, i, generator=g) / i**0.5
        return ExpertWeights(gate_up.to(device, self.dtype), down.to(device, self.dtype))

    def require(self, dispatcher, scoring: str) -> None:
        """Skip the test, saying why, unless ``scoring`` ("hash": hash routing) is both in
        ``supported_scorings`` and claimed by the dispatcher's declared capabilities."""
        if scoring not in self.supported_scorings:
            pytest.skip(f"{type(self).__name__}.supported_scorings leaves out {scoring!r}")
        caps = moe_capabilities(dispatcher)
        if scoring == "hash" and not caps.hash_routing:
            pytest.skip(f"{dispatcher.name} does not claim hash routing (MoECapabilities.hash_routing)")
        if scoring != "hash" and scoring not in caps.scorings:
            pytest.skip(f"{dispatcher.name} does not claim scoring {scoring!r} (MoECapabilities.scorings)")

    def routed(self, dispatcher, spec, device, **kw):
        from dataclasses import replace

        spec = replace(spec, **kw)
        self.require(dispatcher, spec.scoring)
        logits = self.logits(spec, device)
        ids, weights = dispatcher.select_experts(spec, logits)
        return spec, logits, ids, weights

    # -- routing ------------------------------------------------------------------------------
    def test_is_a_dispatcher(self, dispatcher):
        assert isinstance(dispatcher, MoEDispatcher)
        assert isinstance(dispatcher.name, str) and dispatcher.name
        moe_capabilities(dispatcher)  # a declaration, when there is one, is a MoECapabilities

    def test_select_experts_shapes_and_ranges(self, dispatcher, spec, device, scoring):
        spec, logits, ids, weights = self.routed(dispatcher, spec, device, scoring=scoring)
        assert ids.shape == (logits.shape[0], spec.top_k) and ids.dtype == torch.int64
        assert weights.shape == ids.shape and weights.dtype == torch.float32
        assert int(ids.min()) >= 0 and int(ids.max()) < spec.num_experts
        assert all(len(set(row)) == spec.top_k for row in ids.tolist()), "an expert chosen twice for one token"

    def test_picks_highest_scores(self, dispatcher, spec, device, scoring):
        spec, logits, ids, _ = self.routed(dispatcher, spec, device, scoring=scoring)
        best = reference_scores(scoring, logits.cpu()).topk(spec.top_k, dim=-1).indices
        assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in best.tolist()]

    def test_weights_normalised_and_scaled(self, dispatcher, spec, device, scoring):
        spec, logits, ids, weights = self.routed(dispatcher, spec, device, scoring=scoring, routed_scaling=2.5)
        sums = weights.double().sum(dim=-1).cpu()
        torch.testing.assert_close(sums, torch.full_like(sums, 2.5), atol=1e-5, rtol=1e-5)
        scores = reference_scores(scoring, logits.cpu()).gather(1, ids.cpu())
        expect = 2.5 * scores / scores.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(weights.double().cpu(), expect, atol=1e-5, rtol=1e-5)

    def test_unnormalised_weights_are_scaled_scores(self, dispatcher, spec, device):
        spec, logits, ids, weights = self.routed(
            dispatcher, spec, device, scoring="sigmoid", normalize_topk=False, routed_scaling=1.5
        )
        expect = 1.5 * reference_scores("sigmoid", logits.cpu()).gather(1, ids.cpu())
        torch.testing.assert_close(weights.double().cpu(), expect, atol=1e-5, rtol=1e-5)

    def test_correction_bias_steers_selection_not_weights(self, dispatcher, spec, device):
        from dataclasses import replace

        spec = replace(spec, scoring="sigmoid")
        self.require(dispatcher, "sigmoid")
        logits = self.logits(spec, device)
        bias = torch.zeros(spec.num_experts, device=device)
        bias[3] = 10.0  # expert 3 must now always be chosen
        ids, weights = dispatcher.select_experts(spec, logits, bias)
        assert (ids == 3).any(dim=-1).all()
        scores = reference_scores("sigmoid", logits.cpu()).gather(1, ids.cpu())
        torch.testing.assert_close(weights.double().cpu(), scores / scores.sum(-1, keepdim=True), atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("with_bias", [False, True], ids=["max", "top2-with-bias"])
    def test_group_limited_routing_never_picks_masked_groups(self, dispatcher, spec, device, with_bias):
        from dataclasses import replace

        spec = replace(spec, scoring="sigmoid", num_groups=4, topk_groups=2)
        self.require(dispatcher, "sigmoid")
        logits = self.logits(spec, device, tokens=64, seed=5)
        bias = (
            (torch.randn(spec.num_experts, generator=torch.Generator().manual_seed(6)) * 0.1).to(device)
            if with_bias
            else None
        )
        ids, _ = dispatcher.select_experts(spec, logits, bias)
        choice = reference_scores("sigmoid", logits.cpu())
        if bias is not None:
            choice = choice + bias.cpu().double()
        grouped = choice.view(choice.shape[0], spec.num_groups, -1)
        group_score = grouped.topk(2, dim=-1).values.sum(-1) if with_bias else grouped.max(-1).values
        allowed = group_score.topk(spec.topk_groups, dim=-1).indices  # [T, g]
        per_group = spec.num_experts // spec.num_groups
        for t, row in enumerate(ids.cpu().tolist()):
            groups = {e // per_group for e in row}
            assert groups <= set(allowed[t].tolist()), f"token {t} routed into a masked group: {row}"

    # -- DeepSeek-V4: hash routing and sqrtsoftplus --------------------------------------------
    def hash_inputs(self, spec: MoESpec, device, vocab: int = 50, tokens: int = 24):
        g = torch.Generator().manual_seed(7)
        table = torch.stack([torch.randperm(spec.num_experts, generator=g)[: spec.top_k] for _ in range(vocab)])
        token_ids = torch.randint(0, vocab, (tokens,), generator=g)
        return token_ids.to(device), table.to(device)

    def test_hash_routing_follows_the_table(self, dispatcher, spec, device):
        from dataclasses import replace

        spec = replace(spec, scoring="hash", routed_scaling=1.5)
        self.require(dispatcher, "hash")
        logits = self.logits(spec, device)
        token_ids, table = self.hash_inputs(spec, device)
        ids, weights = dispatcher.select_experts(spec, logits, token_ids=token_ids, hash_table=table)
        assert ids.shape == (logits.shape[0], spec.top_k) and ids.dtype == torch.int64
        assert weights.dtype == torch.float32
        got_ids, got_w = _by_expert(ids, weights)
        want_ids = table.cpu()[token_ids.cpu()].long()
        assert torch.equal(got_ids, want_ids.sort(dim=-1).values), "hash layer did not route by the table"
        scores = reference_scores("sqrtsoftplus", logits.cpu()).gather(1, got_ids)
        torch.testing.assert_close(got_w, 1.5 * scores / scores.sum(-1, keepdim=True), atol=1e-5, rtol=1e-5)

    def test_hash_routing_without_token_ids_is_an_error(self, dispatcher, spec, device):
        from dataclasses import replace

        spec = replace(spec, scoring="hash")
        self.require(dispatcher, "hash")
        _, table = self.hash_inputs(spec, device)
        with pytest.raises(ValueError, match="token_ids"):
            dispatcher.select_experts(spec, self.logits(spec, device), hash_table=table)

    @pytest.mark.parametrize("router", ["learned", "hash"])
    def test_v4_routers_match_transformers(self, dispatcher, spec, device, router):
        """Same experts and weights as transformers' DeepseekV4TopKRouter / HashRouter."""
        from dataclasses import replace

        spec = replace(spec, scoring="hash" if router == "hash" else "sqrtsoftplus", routed_scaling=1.5)
        self.require(dispatcher, "hash" if router == "hash" else "sqrtsoftplus")
        token_ids, table = self.hash_inputs(spec, device) if router == "hash" else (None, None)
        modeling, config = _hf_v4(spec, vocab=50)
        g = torch.Generator().manual_seed(11)
        hidden = torch.randn(24, spec.hidden_size, generator=g)
        if router == "hash":
            module = modeling.DeepseekV4HashRouter(config)
            module.tid2eid.copy_(table.cpu())
        else:
            module = modeling.DeepseekV4TopKRouter(config)
            # a bias large enough to change the choice for many tokens
            module.e_score_correction_bias.copy_(torch.randn(spec.num_experts, generator=g) * 0.5)
        with torch.no_grad():
            module.weight.copy_(torch.randn(spec.num_experts, spec.hidden_size, generator=g) / spec.hidden_size**0.5)
            args = (hidden, token_ids.cpu()) if router == "hash" else (hidden,)
            logits, want_w, want_ids = module(*args)
        if router == "hash":
            ids, weights = dispatcher.select_experts(spec, logits.to(device), token_ids=token_ids, hash_table=table)
        else:
            bias = module.e_score_correction_bias.to(device)
            ids, weights = dispatcher.select_experts(spec, logits.to(device), bias)
        got_ids, got_w = _by_expert(ids, weights)
        ref_ids, ref_w = _by_expert(want_ids, want_w)
        assert torch.equal(got_ids, ref_ids)
        torch.testing.assert_close(got_w, ref_w, atol=1e-5, rtol=1e-5)

    def test_v4_clamped_experts_match_transformers(self, dispatcher, spec, device):
        """``forward`` with ``swiglu_limit`` equals transformers' DeepseekV4Experts."""
        from dataclasses import replace

        spec = replace(spec, scoring="sqrtsoftplus", swiglu_limit=0.5)
        self.require(dispatcher, "sqrtsoftplus")
        modeling, config = _hf_v4(spec, vocab=50)
        module = modeling.DeepseekV4Experts(config)
        experts = self.experts(spec, torch.device("cpu"))
        with torch.no_grad():
            module.gate_up_proj.copy_(experts.gate_up.float())
            module.down_proj.copy_(experts.down.float())
        logits = self.logits(spec, device)
        hidden = torch.randn(logits.shape[0], spec.hidden_size, generator=torch.Generator().manual_seed(3)) * 2
        ids, weights = dispatcher.select_experts(spec, logits)
        pre = torch.einsum("td,eod->teo", hidden, experts.gate_up.float())
        assert (pre.abs() > spec.swiglu_limit).float().mean() > 0.2, "the clamp would not be exercised"
        with torch.no_grad():
            want = module(hidden, ids.cpu(), weights.cpu().float())
        out = dispatcher.forward(spec, hidden.to(device, self.dtype), ids, weights, self.experts(spec, device))
        torch.testing.assert_close(out.cpu().float(), want, atol=self.atol, rtol=self.rtol)

    # -- expert compute -----------------------------------------------------------------------
    @pytest.mark.parametrize("swiglu_limit", [None, 0.5], ids=["plain", "clamped"])
    def test_forward_matches_naive_loop(self, dispatcher, spec, device, swiglu_limit):
        from dataclasses import replace

        spec = replace(spec, swiglu_limit=swiglu_limit)
        self.require(dispatcher, spec.scoring)
        experts = self.experts(spec, device)
        logits = self.logits(spec, device)
        hidden = torch.randn(logits.shape[0], spec.hidden_size, generator=torch.Generator().manual_seed(2)).to(
            device, self.dtype
        )
        ids, weights = dispatcher.select_experts(spec, logits)
        out = dispatcher.forward(spec, hidden, ids, weights, experts)
        assert out.shape == hidden.shape and out.dtype == hidden.dtype
        torch.testing.assert_close(
            out.double().cpu(),
            naive_moe(spec, hidden.cpu(), ids.cpu(), weights.cpu(), experts),
            atol=self.atol,
            rtol=self.rtol,
        )

    def test_expert_load_counts_routed_tokens(self, dispatcher, spec, device):
        self.require(dispatcher, spec.scoring)
        experts = self.experts(spec, device)
        dispatcher.expert_load()  # start from a clean counter
        expected = torch.zeros(spec.num_experts, dtype=torch.int64)
        for seed in (0, 1):
            logits = self.logits(spec, device, seed=seed)
            hidden = torch.randn(logits.shape[0], spec.hidden_size).to(device, self.dtype)
            ids, weights = dispatcher.select_experts(spec, logits)
            dispatcher.forward(spec, hidden, ids, weights, experts)
            expected += torch.bincount(ids.cpu().flatten(), minlength=spec.num_experts)
        load = dispatcher.expert_load()
        if load is None:
            pytest.skip(f"{dispatcher.name} does not track expert load")
        assert load.shape == (spec.num_experts,) and load.dtype == torch.int64
        assert torch.equal(load.cpu(), expected)
        after = dispatcher.expert_load()
        assert after is None or int(after.sum()) == 0, "expert_load must reset after it is read"
