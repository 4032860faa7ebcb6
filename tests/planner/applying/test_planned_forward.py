"""planner/applying/planned_forward.py: the recompute follows the forward's op sequence."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

from estimators.step.train_step import TrainStep
from planner import PlanningError, apply_plan, solve_sac, tradeoff_curve
from planner.analysis.measure import measure_steps
from planner.applying.planned_forward import CheckpointDivergenceWarning
from planner.options import PlanOptions


class _SpectralBlocks(nn.Module):
    """GAN-discriminator-like: spectral-norm convs whose weight is computed from a parameter each forward."""

    def __init__(self):
        super().__init__()
        sn = nn.utils.parametrizations.spectral_norm
        self.blocks = nn.Sequential(*[
            nn.Sequential(sn(nn.Conv2d(c_in, 8, 3, padding=1)), nn.LeakyReLU(0.2, inplace=True))
            for c_in in (3, 8)
        ])
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.blocks(x).mean((2, 3)))


@pytest.mark.slow
def test_a_view_only_the_forward_runs_under_memtracker_is_not_a_divergence():
    # torch's ModTracker (inside MemTracker) calls t.view_as(t) on a submodule's grad-requiring
    # inputs in the forward, not in the recompute: the spectral-norm parametrization's parameter.
    # The recompute stopped matching at that view, fell back to full checkpointing (which re-runs
    # the power iteration from the updated vectors: other weights) and the measured steps were
    # neither the predicted peak nor the unplanned training.
    torch.manual_seed(0)
    model, x = _SpectralBlocks(), torch.randn(4, 3, 8, 8)
    ref = copy.deepcopy(model)
    step = TrainStep(inputs=(x,), optimizer="adamw")
    table = tradeoff_curve(model, step, n_points=2)
    budget = (table.min_reachable_peak_bytes + table.no_ac_peak_bytes) / 2
    plan = solve_sac(model, budget_gib=budget / 2**30, step=step)
    assert plan.modules and not all(m.full for m in plan.modules)
    planned = _train_side_by_side(model, ref, plan, step, n_steps=2)
    assert planned[1].peak_bytes == plan.predicted_peak_bytes


def _train_side_by_side(model, ref, plan, step, n_steps):
    """``plan`` applied to ``model``, both trained ``n_steps`` from one seed (no divergence
    allowed) and left bitwise equal; the planned run's measured steps."""
    apply_plan(model, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointDivergenceWarning)
        torch.manual_seed(1)
        planned = measure_steps(model, step, torch.optim.AdamW(model.parameters()), n_steps=n_steps)
    torch.manual_seed(1)
    measure_steps(ref, step, torch.optim.AdamW(ref.parameters()), n_steps=n_steps)
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    return planned


def _plan_at(model, step, frac: float):
    """The plan at ``frac`` of the way from the smallest reachable peak to the no-AC peak."""
    return _plans_at(model, step, (frac,))[0]


def _plans_at(model, step, fracs):
    """``_plan_at`` for each of ``fracs``, the model's bounds read once (two points: the sweep's
    other budgets do not move its floor or its no-AC peak)."""
    table = tradeoff_curve(model, step, n_points=2)
    lo, hi = table.min_reachable_peak_bytes, table.no_ac_peak_bytes
    return [solve_sac(model, (lo + frac * (hi - lo)) / 2**30, step) for frac in fracs]


class _Encoder(nn.Module):
    """torch's own transformer layers: ``self_attn(x, x, x)`` takes one packed projection only
    while ``query is key is value``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 5)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(self.enc(self.emb(x)).mean(1)), y)


def _encoder_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 50, (4, 16), generator=g), torch.randint(0, 5, (4,), generator=g)


@pytest.mark.slow
def test_multihead_self_attention_is_planned_measured_and_trained_unchanged():
    # The planning trace's saved-tensor hooks gave the recompute three tensor objects for
    # attn(x, x, x): three projections instead of the packed one, and solve_sac raised
    # torch's CheckpointError ("Recomputed values ... have different metadata").
    torch.manual_seed(0)
    model, batch = _Encoder(), _encoder_batch()
    ref = copy.deepcopy(model)
    step = TrainStep(inputs=batch, loss_fn=lambda out, inputs: out, optimizer="adamw", micro_batches=2)
    attn = [f"_Encoder.enc.layers.{i}.self_attn" for i in range(2)]
    with pytest.raises(PlanningError) as floor:  # the smallest budget with only attention planned
        solve_sac(model, options=PlanOptions(ac_units=attn), budget_gib=1e-6, step=step)
    plan = solve_sac(model, options=PlanOptions(ac_units=attn), budget_gib=floor.value.min_budget_gib, step=step)
    assert {m.fqn for m in plan.modules} == set(attn)
    planned = _train_side_by_side(model, ref, plan, step, n_steps=3)
    assert [s.peak_bytes for s in planned[1:]] == [plan.predicted_peak_bytes] * 2


class _InplaceActNet(nn.Module):
    """Conv -> BatchNorm(momentum=None) -> in-place activation -> conv blocks, as EfficientNet /
    MobileNetV3 write them."""

    def __init__(self, act) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 32, 1), nn.BatchNorm2d(32, momentum=None), act(), nn.Conv2d(32, 8, 1))
            for _ in range(2))

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = x + b(x)
        return x.square().mean()


@pytest.mark.slow
@pytest.mark.parametrize("act", [lambda: nn.SiLU(inplace=True), lambda: nn.Hardswish(inplace=True)],
                         ids=["silu_", "hardswish_"])
def test_inplace_activations_after_a_batchnorm_train_unchanged_under_any_plan(act):
    # Their backward needs the input the in-place op overwrites, so autograd clones it first.
    # Plans that saved the conv output and recomputed the clone read the overwritten values:
    # every gradient off (up to 0.108 after 3 steps of an EfficientNet). BatchNorm with
    # momentum=None reads its counter with float(), which the fake trace refused.
    torch.manual_seed(0)
    ref = _InplaceActNet(act)
    step = TrainStep(inputs=(torch.randn(4, 3, 8, 8),), optimizer="adamw", micro_batches=2)
    for plan in _plans_at(ref, step, (0.0, 0.5)):
        assert plan.modules
        measured = _train_side_by_side(copy.deepcopy(ref), copy.deepcopy(ref), plan, step, n_steps=3)
        assert [s.peak_bytes for s in measured[1:]] == [plan.predicted_peak_bytes] * 2


class _Lm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.up, self.down = nn.Linear(16, 128), nn.Linear(128, 16)

    def forward(self, x):
        h = self.up(x)
        return self.down(torch.relu(h) * h.sigmoid())


class _CallsTheEmbeddingFirst(nn.Module):
    """LLaVA's order: the wrapper embeds with ``language_model.embed_tokens`` itself, then calls
    ``language_model`` on the embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.lm, self.lm2, self.head = _Lm(), _Lm(), nn.Linear(16, 4)

    def forward(self, ids):
        return self.head(self.lm2(self.lm(self.lm.embed(ids))))


@pytest.mark.slow
def test_a_module_whose_child_ran_before_it_is_planned_and_trains_unchanged():
    # The recorded forward order listed lm.embed before lm, and planning raised GraphError.
    torch.manual_seed(0)
    ref = _CallsTheEmbeddingFirst()
    step = TrainStep(inputs=(torch.randint(0, 100, (8, 64)),), optimizer="adamw")
    plan = _plan_at(ref, step, 0.5)
    assert "_CallsTheEmbeddingFirst.lm" in {m.fqn for m in plan.modules}
    measured = _train_side_by_side(copy.deepcopy(ref), copy.deepcopy(ref), plan, step, n_steps=2)
    assert measured[1].peak_bytes == plan.predicted_peak_bytes


@pytest.mark.slow
def test_a_model_changed_after_apply_says_its_plan_no_longer_holds():
    # .to(torch.bfloat16) after apply measured 1,349,884 B against the fp32 plan's 2,123,932 B,
    # and HF gradient checkpointing enabled after apply nested a second checkpoint: no word.
    from planner import remove_plan
    from planner.applying.planned_forward import StalePlanWarning

    torch.manual_seed(0)
    model = _CallsTheEmbeddingFirst()
    step = TrainStep(inputs=(torch.randint(0, 100, (8, 64)),), optimizer="adamw")
    plan = _plan_at(model, step, 0.5)
    ids = step.inputs[0]
    with apply_plan(model, plan), warnings.catch_warnings():
        warnings.simplefilter("error", StalePlanWarning)
        model(ids).sum().backward()  # as applied: no warning
    apply_plan(model, plan)
    model.to(torch.bfloat16)
    with pytest.warns(StalePlanWarning, match=r"_CallsTheEmbeddingFirst\.lm no longer matches the model: "
                                              r"its parameters are bfloat16 now, float32 when it was applied"):
        model(ids).float().sum().backward()
    remove_plan(model)
    model.float()
    apply_plan(model, plan)
    copied = copy.deepcopy(model).to(torch.bfloat16)  # a copy knows the dtypes it was applied with
    with pytest.warns(StalePlanWarning, match="its parameters are bfloat16 now"):
        copied(ids).float().sum().backward()
    model.lm.gradient_checkpointing = True  # what HF's gradient_checkpointing_enable() sets
    with pytest.warns(StalePlanWarning, match="Hugging Face gradient checkpointing is on for it"):
        model(ids).sum().backward()
    remove_plan(model)
    # On a module around the planned one (HF sets it on decoder layers; the plan may hold their
    # MLPs): no word before, and the measured peak moved off the prediction.
    model.lm.gradient_checkpointing = False
    apply_plan(model, plan)
    twin, pickled = copy.deepcopy(model), pickle.loads(pickle.dumps(model))  # they keep the ancestors
    block = copy.deepcopy(model.lm)  # copied out of its model: no longer inside it
    model.gradient_checkpointing = True
    with warnings.catch_warnings():
        warnings.simplefilter("error", StalePlanWarning)
        block(block.embed(ids)).sum().backward()
    for m in (model, twin, pickled):
        m.gradient_checkpointing = True
        with pytest.warns(StalePlanWarning, match=r"\.lm no longer matches the model: Hugging Face "
                                                  r"gradient checkpointing is on for it or a module around it"):
            m(ids).sum().backward()
    remove_plan(model)


@pytest.mark.slow
def test_a_bigger_batch_than_planned_says_the_plan_no_longer_holds():
    # Planned at batch 8, trained at batch 16: every activation doubles and the step goes over
    # the budget with no word. The same or a smaller batch, and no-grad forwards, stay quiet.
    from planner.applying.planned_forward import StalePlanWarning

    torch.manual_seed(0)
    model = _CallsTheEmbeddingFirst()
    step = TrainStep(inputs=(torch.randint(0, 100, (8, 64)),), optimizer="adamw")
    plan = _plan_at(model, step, 0.5)
    assert all(m.input_numel > 0 for m in plan.modules)
    apply_plan(model, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StalePlanWarning)
        model(step.inputs[0]).sum().backward()
        model(torch.randint(0, 100, (4, 64))).sum().backward()
        with torch.no_grad():
            model(torch.randint(0, 100, (16, 64)))
    with pytest.warns(StalePlanWarning, match=r"no longer matches the model: its inputs have 16,384 "
                                              r"elements, 8,192 when it was planned \(a bigger batch"):
        model(torch.randint(0, 100, (16, 64))).sum().backward()


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 128)

    def forward(self, h):  # the sum keeps nothing of h for backward: the caller may overwrite it
        return torch.sigmoid(self.fc(h.sum(-1, keepdim=True)))


class _ReadsThenOverwrites(nn.Module):
    """Reads a tensor, then overwrites it in place: through an op autograd keeps nothing of
    (the mean) and through a child module that gets it as input (the gate)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.gate, self.down = nn.Linear(32, 128), _Gate(), nn.Linear(128, 32)

    def forward(self, x):
        h = self.up(x)
        m = h.mean(-1, keepdim=True)
        g = self.gate(h)
        h.relu_()
        return self.down(h * g * torch.sigmoid(m))


class _MeanThenRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        h = self.fc(x)
        g = h.mean(-1, keepdim=True)  # reads h before relu_; autograd keeps nothing of it
        h.relu_()
        return self.out(h * torch.sigmoid(g)) + x


@pytest.mark.slow
@pytest.mark.parametrize("block", [_ReadsThenOverwrites, _MeanThenRelu])
def test_reads_before_an_inplace_overwrite_train_unchanged_under_any_plan(block):
    # Plans recomputed the mean from the overwritten h (gradients 232 off), and a checkpointed
    # gate re-read its input after the caller's relu_ (2,011 off), both with no warning.
    torch.manual_seed(0)
    ref = nn.Sequential(*[block() for _ in range(3)])
    step = TrainStep(inputs=(torch.randn(256, 32),), optimizer="adamw")
    for plan in _plans_at(ref, step, (0.0, 0.2, 0.4, 0.8)):
        assert "Sequential.0.gate" not in {m.fqn for m in plan.modules}
        measured = _train_side_by_side(copy.deepcopy(ref), copy.deepcopy(ref), plan, step, n_steps=2)
        assert measured[1].peak_bytes == plan.predicted_peak_bytes
    if block is _ReadsThenOverwrites:
        assert any("Sequential.0.gate not checkpointed: reads a tensor the caller later overwrites in "
                   "place (aten.relu_.default)" in n for n in plan.notes)


class _Centred(nn.Module):
    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)
        object.__setattr__(self, "owner", owner)  # not a submodule: the parent's buffer is read

    def forward(self, x):
        return self.down(torch.tanh(self.up(x) - self.owner.center))


class _UpdatesItsCentre(nn.Module):
    """A running centre the parent updates in place after each block read it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("center", torch.zeros(64))
        self.blocks = nn.ModuleList(_Centred(self) for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
            self.center.mul_(0.5).add_(1.0)
        return x


@pytest.mark.slow
def test_a_buffer_the_caller_updates_after_the_call_keeps_the_reader_unplanned():
    # The recompute read the updated centre: gradients 84.7 off, no warning (buffers were exempt).
    torch.manual_seed(0)
    ref = _UpdatesItsCentre()
    step = TrainStep(inputs=(torch.randn(64, 16),), optimizer="adamw")
    peak = tradeoff_curve(ref, step, n_points=2).no_ac_peak_bytes
    with pytest.raises(PlanningError, match=r"_UpdatesItsCentre\.blocks\.0 \(reads a tensor the caller "
                                            r"later overwrites in place"):
        solve_sac(ref, 0.9 * peak / 2**30, step)


class _Attn(nn.Module):
    """Parameter-free attention core: a plan of it has no parameters of its own to watch."""

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) @ v


class _AttnNet(nn.Module):
    def __init__(self, vocab: int = 16, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(n))
        self.cores = nn.ModuleList(_Attn() for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for qkv, core in zip(self.qkv, self.cores):
            x = x + core(*qkv(x).chunk(3, -1))
        return self.head(x)


def _apply_cores(model):
    """Full checkpoints of the parameter-free attention cores only."""
    from planner.applying.checkpointing import apply_module_plans
    from planner.plan import ModulePlan

    return apply_module_plans(model, [ModulePlan(fqn=f"_AttnNet.cores.{i}", discard_ratio=1.0, full=True)
                                      for i in range(3)])


@pytest.mark.slow
def test_a_model_changed_elsewhere_after_apply_says_its_plan_no_longer_holds():
    # Measured before: .double() on a model whose planned modules hold no parameters, +97 % over
    # the prediction; resize_token_embeddings, +592 %; unfrozen layers, +46 %: no word.
    from planner import remove_plan
    from planner.applying.planned_forward import StalePlanWarning

    torch.manual_seed(0)
    model = _AttnNet()
    step = TrainStep(inputs=(torch.randint(0, 16, (4, 64)),), optimizer="adamw")
    ids = step.inputs[0]

    def quiet(m, x=ids):
        with warnings.catch_warnings():
            warnings.simplefilter("error", StalePlanWarning)
            m(x).float().sum().backward()

    with _apply_cores(model):
        quiet(model)
        model.head.requires_grad_(False)  # freezing only lowers the peak: no word
        quiet(model)
        model.head.requires_grad_(True)
    cases = [
        (lambda m: m.double(), r"the model's parameters are float64 now, float32 when the plan was applied"),
        (lambda m: setattr(m, "embed", nn.Embedding(4096, 16)),
         r"the model has [\d,]+ parameter elements, [\d,]+ when the plan was applied"),
    ]
    for change, message in cases:
        torch.manual_seed(0)
        changed = _AttnNet()
        with _apply_cores(changed):
            change(changed)
            with pytest.warns(StalePlanWarning, match=r"no longer matches the model: " + message):
                changed(ids).float().sum().backward()
            twin = copy.deepcopy(changed)  # the copy warns once too: it knows what was applied
            with pytest.warns(StalePlanWarning, match=message):
                twin(ids).float().sum().backward()
    # Planned with the head frozen, trained with it unfrozen: warned at apply and in the step.
    torch.manual_seed(0)
    model, ids = _CallsTheEmbeddingFirst(), torch.randint(0, 100, (8, 64))
    full_plan = _plan_at(model, TrainStep(inputs=(ids,), optimizer="adamw"), 0.5)
    model.head.requires_grad_(False)  # a warm-up freeze, applied during it, then unfrozen back:
    with apply_plan(model, full_plan):  # the plan counted the head's gradients: no word
        quiet(model, ids)
        model.head.requires_grad_(True)
        quiet(model, ids)
    model.head.requires_grad_(False)
    frozen_plan = _plan_at(model, TrainStep(inputs=(ids,), optimizer="adamw"), 0.5)
    assert frozen_plan.modules
    model.head.requires_grad_(True)
    with pytest.warns(StalePlanWarning, match=r"68 more parameter elements of this _CallsTheEmbeddingFirst "
                                              r"require grad than when the plan was made"):
        handle = apply_plan(model, frozen_plan)
    handle.remove()
    model.head.requires_grad_(False)
    with apply_plan(model, frozen_plan):
        quiet(model, ids)
        model.head.requires_grad_(True)
        with pytest.warns(StalePlanWarning, match=r"68 more parameter elements require grad than when the "
                                                  r"plan was applied"):
            model(ids).sum().backward()
    remove_plan(model)
