"""planner/planning/pipeline_solve.py: a stage planned over its schedule (fake traces)."""

import math

import pytest
import torch
from torch.distributed.pipelining import (Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                         ScheduleLoopedBFS)

from examples.pipeline_stages import llama_pipeline_model, llama_stage, stage_loss
from planner import PlanOptions, PlanningError, TrainStep, solve_sac
from planner.distributed.pipeline import Pipeline, RankPlanner, pipeline_step
from planner.format import GiB


@pytest.fixture(scope="module")
def four_stages():
    """A 4-layer Llama in 4 stages (one layer each), each stage's input for one micro-batch."""
    full = llama_pipeline_model(n_layers=4)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    out, h = [], tokens
    for s in range(4):
        stage = llama_stage(full, s, 4)
        out.append((stage, TrainStep(inputs=h, loss_fn=stage_loss, optimizer="adamw",
                                     target=tokens if s == 3 else None)))
        with torch.no_grad():
            h = stage(h)
    return out


def _options(s: int, **kw) -> PlanOptions:
    return PlanOptions(pipeline=Pipeline(Schedule1F1B, n_microbatches=8, stage_index=s, n_stages=4, **kw))


@pytest.mark.slow
def test_1f1b_stages_get_their_own_plans_for_their_in_flight_counts(four_stages):
    """Stage s of 1F1B holds 4 - s micro-batches: unplanned peaks fall down the pipe (traced:
    2,324,520 / 1,843,748 / 1,547,300 B; the last stage, its logits, 2,057,292), and at one budget
    of 1.6 MB each of the first three discards what its count needs: stage 0 most, stage 2 nothing."""
    planners = [RankPlanner({s: four_stages[s]}, options=_options(s)) for s in range(4)]
    peaks = [rp.unplanned_peak_bytes for rp in planners]
    assert peaks[0] > peaks[1] > peaks[2]
    budgets = [1_600_000] * 3 + [peaks[3] + 1]
    plans = [rp.plan(b / GiB)[s] for s, (rp, b) in enumerate(zip(planners, budgets))]
    freed = [sum(m.discarded_bytes for m in p.modules) for p in plans]
    assert freed[0] > freed[1] > freed[2] == 0 and freed[3] == 0
    assert all(p.predicted_peak_bytes <= b for p, b in zip(plans, budgets))
    assert plans[0].pipeline.stage_index == 0 and plans[0].pipeline.schedule == "Schedule1F1B"
    assert plans[0].baseline_peak_bytes == peaks[0]
    step = pipeline_step(plans)
    assert step.makespan_ms > 0 and set(step.bubble_fractions) == {0, 1, 2, 3}
    assert "pipeline         stage 0 of 4 (Schedule1F1B, 8 micro-batches)" in plans[0].summary()


@pytest.mark.slow
def test_solve_sac_plans_a_stage_and_says_what_it_needs(four_stages):
    stage, step = four_stages[3]
    plan = solve_sac(stage, 1.0, step, options=_options(3))
    assert plan.modules == () and plan.pipeline.rank_stages == (3,)
    with pytest.raises(PlanningError, match="pass TrainStep\\(target=...\\)"):
        solve_sac(stage, 1.0, TrainStep(inputs=step.inputs, loss_fn=stage_loss), options=_options(3))
    with pytest.raises(PlanningError, match="leave TrainStep.micro_batches at 1"):
        solve_sac(four_stages[1][0], 1.0, TrainStep(inputs=four_stages[1][1].inputs, micro_batches=2),
                  options=_options(1))
    interleaved = PlanOptions(pipeline=Pipeline(ScheduleInterleaved1F1B, n_microbatches=4, stage_index=1,
                                                n_stages=4, virtual_stages=2))
    with pytest.raises(PlanningError, match="shares its rank with stages \\[1, 3\\].*solve_pipeline_rank"):
        solve_sac(four_stages[1][0], 1.0, four_stages[1][1], options=interleaved)
    with pytest.raises(PlanningError, match="smallest reachable peak over its schedule"):
        solve_sac(stage, 1e-4, step, options=_options(3))


@pytest.mark.slow
def test_a_plan_that_verifies_over_is_stepped_past_until_one_fits(monkeypatch):
    """The last of 4 GPipe stages (8 layers, 8 micro-batches) at 4,309,609 B, where the MILP's
    first plans are taken to verify 695 B over the usable budget (as a misjudged plan did before
    the memory points split backward at gradient writes): the planner tightens its target past
    them and returns a plan whose own trace fits, saying so in its notes."""
    import dataclasses

    from torch.distributed.pipelining import ScheduleGPipe

    from planner.planning.pipeline_solve import RankPlanner as Planner

    full = llama_pipeline_model()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    h = tokens
    with torch.no_grad():
        for s in range(3):
            h = llama_stage(full, s, 4)(h)
    step = TrainStep(inputs=h, loss_fn=stage_loss, optimizer="adamw", target=tokens)
    options = PlanOptions(pipeline=Pipeline(ScheduleGPipe, n_microbatches=8, stage_index=3, n_stages=4))
    budget = 4_309_609
    planner = RankPlanner({3: (llama_stage(full, 3, 4), step)}, options=options)
    usable = budget - planner.plan(budget / GiB)[3].reserve_bytes
    real, seen = Planner._verify, []

    def misjudged(self, modules):
        verified, profiles = real(self, modules)
        seen.append((modules, verified.peak_bytes))
        if len(seen) <= 2:  # the first two plans tried
            verified = dataclasses.replace(verified, peak_bytes=usable + 695)
        return verified, profiles

    monkeypatch.setattr(Planner, "_verify", misjudged)
    plan = RankPlanner({3: (llama_stage(full, 3, 4), step)}, options=options).plan(budget / GiB)[3]
    assert sum("overshot" in n and "target tightened" in n for n in plan.notes) == 2, plan.notes
    assert len(seen) == 3 and seen[2][0] != seen[0][0]
    assert plan.modules and plan.predicted_peak_bytes == seen[2][1] <= usable


def test_a_micro_batch_sliced_from_the_batch_counts_the_batch_once():
    """``inputs=x[:mb]`` views the batch the loop holds: its storage is that batch, and n
    micro-batches of it are the batch once (it was n times the whole storage: +6,144 B here)."""
    full = llama_pipeline_model(n_layers=4)
    tokens = torch.randint(0, 256, (4 * 2, 32), generator=torch.Generator().manual_seed(0))
    stage = llama_stage(full, 0, 4)
    options = PlanOptions(pipeline=Pipeline(Schedule1F1B, n_microbatches=4, stage_index=0, n_stages=4))
    peaks = [RankPlanner({0: (stage, TrainStep(inputs=x, loss_fn=stage_loss, optimizer="adamw"))}, options=options)
             for x in (tokens[:2], tokens[:2].clone())]
    assert peaks[0].kw["batch_bytes"] == peaks[1].kw["batch_bytes"] == tokens.nbytes
    assert peaks[0].unplanned_peak_bytes == peaks[1].unplanned_peak_bytes


class _GPT2Stage(torch.nn.Module):
    """Blocks of examples.gpt's GPT (GPT-2's: LayerNorm, GELU MLP), the embeddings on stage 0."""

    def __init__(self, model, ids, first):
        super().__init__()
        self.tok_emb, self.pos_emb = (model.tok_emb, model.pos_emb) if first else (None, None)
        self.blocks = torch.nn.ModuleDict({str(i): model.blocks[i] for i in ids})

    def forward(self, x):
        if self.tok_emb is not None:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1]))
        for block in self.blocks.values():
            x = block(x)
        return x


@pytest.mark.slow
def test_a_plan_recomputes_no_more_than_the_steps_its_ops_can_take_need():
    """Stage 0 of a GPT-2-style 4-stage 1F1B (4 micro-batches in flight) at 70 % of the way from its
    floor to its unplanned peak: the MILP discards 62 % of blocks.0.mlp, whose op plan can only
    discard all of it (two equal outputs), so it recomputed 0.1887 ms and verified 8.2 % under the
    budget. The least a plan on whole op steps needs there (every plan enumerated) is 0.1363 ms."""
    from examples.gpt import GPTConfig, build_gpt
    from planner.planning.module_plans import module_plan
    from solver.graph import is_submodule

    torch.manual_seed(0)
    model, _ = build_gpt(GPTConfig(vocab_size=512, seq_len=64, n_layer=8, n_head=4, dim=64, dropout=0.0), batch_size=4)
    stage = _GPT2Stage(model, range(2), first=True)
    tokens = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    options = PlanOptions(pipeline=Pipeline(Schedule1F1B, n_microbatches=8, stage_index=0, n_stages=4))
    rp = RankPlanner({0: (stage, TrainStep(inputs=tokens, loss_fn=stage_loss, optimizer="adamw"))}, options=options)
    budget = int(rp.min_peak_bytes() + 0.7 * (rp.unplanned_peak_bytes - rp.min_peak_bytes()))
    plan = rp.plan(budget / GiB)[0]
    memory, names = rp.milp.memory, [c.fqn for c in rp.milp.candidates]

    def ms(f, d):
        return module_plan(rp.traced[0].module_info.stats(rp.names[f][1]), d).recompute_ms

    def least(i, chosen, cost):  # every plan of whole steps that fits, cheapest first found
        if i == len(names):
            return cost if memory.peak(chosen) <= budget else math.inf
        f, best = names[i], least(i + 1, chosen, cost)
        if not any(is_submodule(f, g) or is_submodule(g, f) for g in chosen):
            for d in sorted(set(memory.stats[f].tradeoff.discarded_bytes))[1:]:
                best = min(best, least(i + 1, {**chosen, f: d}, cost + ms(f, d)))
        return best

    optimum = least(0, {}, 0.0)
    print(f"budget {budget}, verified {plan.predicted_peak_bytes}, recompute {plan.recompute_ms:.4f} ms, "
          f"least on op steps {optimum:.4f} ms")
    assert plan.predicted_peak_bytes <= budget
    assert plan.recompute_ms <= optimum * (1 + 1e-9)


def test_fsdp2_inside_a_stage_is_read_from_the_stage_and_what_is_not_modelled_refused(four_stages):
    """A stage's FSDP2 units are read from ``fully_shard``'s state: fsdp_units, world_size over 1
    on a stage that was not sharded, a stage sharded with FSDP2's default (non-root units
    reshard after forward) and offload are refused before any trace, each with what to do."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from planner.distributed.fake_world import fake_process_group

    stage, step = four_stages[1]
    units = PlanOptions(fsdp_units=("LlamaStage",), world_size=2, pipeline=_options(1).pipeline)
    with pytest.raises(PlanningError, match="FSDP2 units are read from the stage: fully_shard it first"):
        RankPlanner({1: (stage, step)}, options=units)
    zero = PlanOptions(world_size=2, pipeline=_options(1).pipeline)
    with pytest.raises(PlanningError, match=r"world_size=2 \(a mesh.s dp dim\) inside a pipeline stage means FSDP2.*fully_shard the stage"):
        RankPlanner({1: (stage, step)}, options=zero)
    with fake_process_group(world_size=2, rank=0):
        sharded = llama_stage(llama_pipeline_model(n_layers=4), 1, 4)
        mesh = init_device_mesh("cpu", (2,))
        for layer in sharded.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        with pytest.raises(PlanningError, match="reshards after forward.*reshard_after_forward=False"):
            RankPlanner({1: (sharded, step)}, options=_options(1))
        # a runtime schedule's UNSHARD gathers a root unit at the step's start; a split backward
        root_only = {s: (fully_shard(llama_stage(llama_pipeline_model(n_layers=4), s, 4), mesh=mesh), four_stages[s][1])
                     for s in (0, 2)}
        interleaved = PlanOptions(pipeline=Pipeline(ScheduleInterleaved1F1B, n_microbatches=4, stage_index=0,
                                                    n_stages=4, virtual_stages=2))
        with pytest.raises(PlanningError, match="stage 0's root FSDP2 unit holds parameters: ScheduleInterleaved1F1B"):
            RankPlanner(root_only, options=interleaved)
        zero_bubble = PlanOptions(pipeline=Pipeline(ScheduleInterleavedZeroBubble, n_microbatches=4, stage_index=0,
                                                    n_stages=4, virtual_stages=2))
        with pytest.raises(PlanningError, match="without a split backward; ScheduleInterleavedZeroBubble"):
            RankPlanner(root_only, options=zero_bubble)
        one = RankPlanner({0: root_only[0]}, options=_options(0))  # 1F1B gathers the root unit in its forward
        looped = PlanOptions(pipeline=Pipeline(ScheduleLoopedBFS, n_microbatches=8, stage_index=0, n_stages=4))
        with pytest.raises(PlanningError, match="root FSDP2 unit holds parameters: ScheduleLoopedBFS"):
            one.for_options(looped)
    with pytest.raises(PlanningError, match="without offload for now"):
        RankPlanner({1: (stage, step)}, options=PlanOptions(offload=True, pipeline=_options(1).pipeline))


def test_stages_of_the_wrong_shape_are_refused_in_one_line():
    from planner.distributed.pipeline import solve_pipeline_rank

    module = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(30)])  # a long repr
    step = TrainStep(inputs=torch.randn(2, 8))
    options = PlanOptions(pipeline=Pipeline(Schedule1F1B, n_microbatches=2, n_stages=2))
    for bad, message in (({0: module}, r"stages\[0\] must be a \(module, TrainStep\) pair, got a Sequential"),
                         ([module], "stages must be a non-empty dict, got list"),
                         ({}, "non-empty dict"),
                         ({"0": (module, step)}, r"keys are stage indices \(int\), got str"),
                         ({0: (module,)}, r"got a tuple of \(Sequential\)"),
                         ({0: (step, module)}, r"got a tuple of \(TrainStep, Sequential\)")):
        with pytest.raises(TypeError, match=message) as e:
            solve_pipeline_rank(bad, 1.0, options=options)
        assert "\n" not in str(e.value) and len(str(e.value)) < 200
    with pytest.raises(PlanningError, match="needs options=PlanOptions"):
        solve_pipeline_rank({0: (module, step)}, 1.0, options=None)


def test_the_last_stage_output_is_let_go_after_the_input_half_without_return_outputs():
    """PP 4 InterleavedZeroBubble, 8 micro-batches of 1 x 32 tokens, rank 3 (stages 3 and 7 of a
    one-layer-per-stage Llama, vocabulary 256): measured on 4 gloo ranks with
    ``step(return_outputs=False)`` as torchtitan steps (benchmarks/search_ranks.py), MemTracker's
    steady peak is 3,623,544 B. The schedule's ``fwd_cache`` lets go of the last stage's logits
    when the input half returns; holding them to the weight half, as the traced frame does, put
    each micro-batch waiting for its weight half 32,768 B too high (3,721,848 B)."""
    from benchmarks.search_ranks import small_llama
    from examples.pipeline_stages import LlamaStage, layer_ranges

    full, _ = small_llama(device="cpu")
    ranges, tokens = layer_ranges(8, 8), torch.zeros(1, 32, dtype=torch.long)
    stages = {s: (LlamaStage(full, ranges[s], first=False, last=s == 7),
                  TrainStep(inputs=torch.zeros(1, 32, 64), loss_fn=stage_loss if s == 7 else None,
                            optimizer="adamw", target=tokens if s == 7 else None)) for s in (3, 7)}
    peaks = {}
    for keep in (False, True):
        options = PlanOptions(device="cpu", pipeline=Pipeline(
            ScheduleInterleavedZeroBubble, n_microbatches=8, stage_index=3, n_stages=8, virtual_stages=2,
            return_outputs=keep))
        peaks[keep] = RankPlanner(stages, options=options).unplanned_peak_bytes
    assert peaks[False] == 3_623_544
    assert peaks[True] > peaks[False]  # the chunks, held to the next step


def test_a_budget_above_the_gpus_memory_is_refused_before_any_trace():
    """``budget_gib=120`` for an 80 GiB H100 plans for memory the device does not have: refused
    in one line by ``solve_pipeline_rank`` and ``plan_layout_rank`` as by ``solve_sac``."""
    from planner.distributed.pipeline import plan_layout_rank, solve_pipeline_rank

    def untraceable(*_):
        raise AssertionError("traced before the budget was checked")

    options = PlanOptions(device="h100", pipeline=Pipeline(Schedule1F1B, n_microbatches=4, stage_index=0, n_stages=2))
    stages = {0: (torch.nn.Linear(2, 2), TrainStep(inputs=torch.zeros(1, 2)))}
    with pytest.raises(PlanningError, match=r"budget_gib 120 GiB is more than the h100's 80 GiB"):
        solve_pipeline_rank(stages, 120, options=options)
    with pytest.raises(PlanningError, match=r"budget_gib 120 GiB is more than the h100's 80 GiB"):
        plan_layout_rank(untraceable, 120, mesh_shape={"pp": 2}, rank=0, schedule=Schedule1F1B,
                         n_microbatches=4, options=PlanOptions(device="h100"))
