"""Real libraries' models (torchvision's ResNet, VGG and ViT, Hugging Face's Llama, BERT and
Mamba) cut into pipeline stages by split_model, unchanged.

In one process: the stages compose to the model's own forward (logits and loss), hold its
parameters (no copies), report the parameters that two stages share, and splitting registers
nothing (the models' own norms are deferred only once registered). On two gloo ranks:
a pipelined step with 2BP (GPipe, 1F1B-1) and without (GPipe) gives every parameter the
gradient, and every buffer the value, of the model itself run in one process on the same
micro-batches, tied embeddings included once :class:`TiedGradients` has summed them; and so
does a Llama in 4 stages, two per rank (interleaved 1F1B, ZB-V), whose tied embedding's uses sit
on two ranks (the loop) or one (the V).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import twobp_autograd as twobp
from tests.ranks import gloo_rank_main, read_results, run_ranks
from tests.utils import close_to_reference
from twobp_autograd import registry
from twobp_autograd.pipeline import PipelineRuntime, StepReport, default_num_micro_batches, placement, schedule
from twobp_autograd.pipeline.split import PipelineModel, TiedGradients, blocks_of, defer_norms, split_model

torchvision = pytest.importorskip("torchvision")
transformers = pytest.importorskip("transformers")

from tests import tiny_models  # noqa: E402  (after the importorskip above)

VOCAB, HIDDEN, LAYERS, SEQUENCE, BATCH = 64, 16, 2, 8, 4
WORLD = 2
RUNTIME_TIMEOUT = 60.0


# -- the models --------------------------------------------------------------------------------


def tiny_llama(attention: str = "sdpa") -> nn.Module:
    return tiny_models.llama(VOCAB, HIDDEN, LAYERS, SEQUENCE, attention)


def tiny_bert() -> nn.Module:
    return tiny_models.bert(VOCAB, HIDDEN, LAYERS, SEQUENCE)


def tiny_mamba() -> nn.Module:
    return tiny_models.mamba(VOCAB, HIDDEN, LAYERS, state_size=4, conv_kernel=3)


def small_resnet() -> nn.Module:
    # zero_init_residual: every block starts as the identity, which keeps tiny-batch
    # BatchNorm gradients tame (see tests/test_patch_whole_models.py).
    return torchvision.models.resnet18(num_classes=5, zero_init_residual=True)


def token_batch(g: torch.Generator) -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=g)
    labels = ids.clone()  # causal models shift the labels themselves
    # Padded rows, as a data collator makes them: the loss averages over fewer tokens there.
    for row, start in enumerate(torch.randint(2, SEQUENCE + 1, (BATCH,), generator=g).tolist()):
        labels[row, start:] = -100
    return ids, labels


def masked_batch(g: torch.Generator) -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.5] = -100  # positions the loss ignores
    return ids, labels


def image_batch(g: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def hf_loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    return model(input_ids=inputs, labels=targets).loss


def classifier_loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(model(inputs), targets)


def _mixers(stage: nn.Module) -> set[str]:
    return {name for name, module in stage.named_modules() if name.endswith(".mixer")}


#: id -> (model, batch, the model's own loss, modules of a stage that patch leaves on plain
#: autograd). BERT's head holds its decoder's bias itself (the patched decoder uses it);
#: MambaMixer reads A_log, D, conv1d and dt_proj's parameters itself.
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable, Callable, Callable[[nn.Module], set[str]]]] = {
    "resnet18": (small_resnet, image_batch, classifier_loss, lambda stage: set()),
    "llama": (tiny_llama, token_batch, hf_loss, lambda stage: set()),
    "bert": (
        tiny_bert, masked_batch, hf_loss, lambda stage: {n for n, _ in stage.named_modules() if n == "head.predictions"}
    ),
    "mamba": (tiny_mamba, token_batch, hf_loss, _mixers),
}
TIED = {"llama", "bert", "mamba"}
#: (schedule, 2BP on)
SCHEDULE_SETTINGS = [("gpipe", True), ("1f1b-1", True), ("gpipe", False)]
SETTING_IDS = [f"{model}-{name}-{'2bp' if on else 'plain'}" for model in MODELS for name, on in SCHEDULE_SETTINGS]


# -- in one process ----------------------------------------------------------------------------


def vgg() -> nn.Module:
    """A VGG with torchvision's own layer maker and a test-sized classifier (its stock one
    takes 512 x 7 x 7 features into 4096 units, 100M parameters)."""
    from torchvision.models.vgg import make_layers

    model = torchvision.models.VGG(make_layers([8, "M", 16, "M"], batch_norm=True), num_classes=5, dropout=0.0)
    model.avgpool = nn.AdaptiveAvgPool2d(2)
    model.classifier = nn.Sequential(nn.Linear(16 * 2 * 2, 8), nn.ReLU(True), nn.Dropout(0.0), nn.Linear(8, 5))
    return model


def vit() -> nn.Module:
    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=5
    )


#: (ResNets: tests/pipeline/split/test_split_model.py, and below on two ranks.)
COMPOSE_CASES = [
    ("vgg-bn", vgg, image_batch, classifier_loss, 3),
    ("vit", vit, image_batch, classifier_loss, 3),
    ("llama", tiny_llama, token_batch, hf_loss, 2),
    # eager attention takes the causal mask as a tensor: each stage must rebuild it
    ("llama-eager", lambda: tiny_llama("eager"), token_batch, hf_loss, 2),
    ("bert", tiny_bert, masked_batch, hf_loss, 2),
    ("mamba", tiny_mamba, token_batch, hf_loss, 3),
]


def _prefixed(prefix: str) -> Callable[[str], str]:
    """assert_close's message: its own, after ``prefix``."""
    return lambda message: f"{prefix}: {message}"


@pytest.mark.parametrize(
    "make_model, make_batch, loss, num_stages", [c[1:] for c in COMPOSE_CASES], ids=[c[0] for c in COMPOSE_CASES]
)
def test_stages_compose_to_the_models_forward(
    make_model: Callable, make_batch: Callable, loss: Callable, num_stages: int
) -> None:
    model = make_model().train()
    reference = copy.deepcopy(model)
    inputs, targets = make_batch(torch.Generator().manual_seed(0))
    rules = dict(registry._rules)
    pipeline = split_model(model, num_stages)
    assert len(pipeline.stages) == num_stages
    assert registry._rules == rules, "splitting registered a rule"

    x = inputs
    with warnings.catch_warnings():
        # The stages call the library as its current release wants (a deprecated keyword warns
        # that a later release drops it).
        warnings.simplefilter("error", FutureWarning)
        for stage in pipeline.stages:
            x = stage(x)
    expected_loss = loss(reference, inputs, targets)
    torch.testing.assert_close(pipeline.loss_fn(x, targets), expected_loss, rtol=1e-6, atol=1e-6)
    pipeline.loss_fn(x, targets).backward()
    expected_loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=_prefixed(name))

    # The stages hold the model's own parameters, each of them exactly once over all stages
    # but for the tied ones, which each holding stage lists.
    model_params = {id(p) for p in model.parameters()}
    held = [id(p) for stage in pipeline.stages for p in stage.parameters()]
    assert set(held) == model_params
    assert len(held) == len(model_params) + sum(len(t.stages) - 1 for t in pipeline.ties)


@pytest.mark.parametrize(
    "make_model, tied_name",
    [
        (tiny_llama, "model.embed_tokens.weight"),
        (tiny_bert, "bert.embeddings.word_embeddings.weight"),
        (tiny_mamba, "backbone.embeddings.weight"),
    ],
    ids=["llama", "bert", "mamba"],
)
def test_tied_embeddings_are_reported_across_first_and_last_stage(make_model: Callable, tied_name: str) -> None:
    model = make_model()
    pipeline = split_model(model, 2)
    assert [(t.name, t.stages) for t in pipeline.ties] == [(tied_name, (0, 1))]
    assert pipeline.ties[0].parameter is model.get_input_embeddings().weight
    assert split_model(model, 1).ties == []  # one stage: autograd sums the two uses


def test_blocks_are_embedding_layers_head_and_costs_cut_between_them() -> None:
    model = tiny_llama()
    assert len(blocks_of(model)) == LAYERS + 2
    first, last = split_model(model, 2, costs=[1.0, 1.0, 1.0, 100.0]).stages
    assert first.embed is not None and len(first.layers) == LAYERS and first.head is None
    assert last.embed is None and len(last.layers) == 0 and last.head is not None
    with pytest.raises(ValueError, match="twobp: 3 costs for 4 blocks"):
        split_model(model, 2, costs=[1.0, 1.0, 1.0])


def test_unknown_models_are_refused() -> None:
    class Custom(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x

    with pytest.raises(TypeError, match="twobp: cannot split a Custom"):
        split_model(Custom(), 2)


@pytest.mark.parametrize(
    "make_model, norm", [(tiny_llama, "LlamaRMSNorm"), (tiny_mamba, "MambaRMSNorm")], ids=["llama", "mamba"]
)
def test_the_models_own_norms_are_deferred(make_model: Callable, norm: str) -> None:
    model = make_model()
    stages = split_model(model, 2).stages
    assert any(norm in why for why in twobp.patch(copy.deepcopy(stages[1]), report=True).skipped.values())
    assert [t.__name__ for t in defer_norms(model)] == [norm]
    report = twobp.patch(stages[1], report=True)
    assert not any(norm in why for why in report.skipped.values())
    assert any(type(module).__name__ == norm for name, module in stages[1].named_modules() if name in report.patched)


def test_convnext_layer_norm_2d_is_deferred() -> None:
    """torchvision's LayerNorm2d (an nn.LayerNorm subclass with a channels-first forward) was
    named in defer_norms' docs but not matched by its name test ("...LayerNorm" only)."""
    from torchvision.models import convnext_tiny
    from torchvision.models.convnext import LayerNorm2d

    assert LayerNorm2d in defer_norms(convnext_tiny())  # conftest forgets the registration after


# -- on two ranks -------------------------------------------------------------------------------


def _differs(a: Tensor | None, b: Tensor | None) -> bool:
    return a is None or b is None or not close_to_reference(a, b)


def _check_model(rank: int, model_name: str) -> dict:
    make_model, make_batch, loss, expected_skipped = MODELS[model_name]
    torch.manual_seed(0)
    model = make_model().train()
    reference = copy.deepcopy(model)
    defer_norms(model)  # Llama's and Mamba's own RMSNorms too (in this spawned rank only)
    pipeline: PipelineModel = split_model(model, WORLD)
    stage = pipeline.stages[rank]
    tied = TiedGradients(pipeline)
    names = {id(p): name for name, p in model.named_parameters()}
    buffer_names = {id(b): name for name, b in model.named_buffers()}
    reference_params, reference_buffers = dict(reference.named_parameters()), dict(reference.named_buffers())
    tied_here = [t for t in pipeline.ties if rank in t.stages]
    generator = torch.Generator().manual_seed(1)
    results: dict = {}
    for schedule_name, twobp_on in SCHEDULE_SETTINGS:
        m = default_num_micro_batches(schedule_name, WORLD)
        actions = schedule(schedule_name, WORLD, m, twobp_on)[rank]
        runtime = PipelineRuntime(
            stage, actions, num_micro_batches=m, loss_fn=pipeline.loss_fn, twobp=twobp_on, timeout=RUNTIME_TIMEOUT,
            loss_items=pipeline.loss_items,
        )  # fmt: skip
        result: dict = {"skipped": set(twobp.patch(stage, report=True).skipped) if twobp_on else None}
        inputs, targets = make_batch(generator)
        report = runtime.step(inputs if rank == 0 else None, targets if rank == WORLD - 1 else None)
        own = report.ranks[rank] if isinstance(report, StepReport) else report
        result["deferred_jobs"] = own.deferred_jobs
        result["loss"] = report.loss if isinstance(report, StepReport) else None

        # One process's mean over the batch: over its samples, or over the tokens whose label is
        # not -100 (each micro-batch's mean weighted by its share of them: the loss as one call on
        # the whole batch computes it, with BatchNorm's statistics still per micro-batch).
        items = pipeline.loss_items or (lambda y: len(y))
        total = sum(items(y) for y in targets.tensor_split(m))
        reference_loss = 0.0
        for x, y in zip(inputs.tensor_split(m), targets.tensor_split(m), strict=True):
            micro_loss = loss(reference, x, y) * (items(y) / total)
            micro_loss.backward()
            reference_loss += micro_loss.item()
        result["reference_loss"] = reference_loss

        # Before the sum each rank holds its own use's part of a tied gradient only.
        result["tie_partial_before_sync"] = [
            _differs(t.parameter.grad, reference_params[t.name].grad) for t in tied_here
        ]
        tied.all_reduce()
        result["tied"] = [t.name for t in tied_here]

        mismatches = []
        for p in stage.parameters():
            name = names[id(p)]
            if _differs(p.grad, reference_params[name].grad):
                mismatches.append(f"{name}.grad")
        for b in stage.buffers():
            name = buffer_names[id(b)]
            reference_buffer, floating = reference_buffers[name], b.is_floating_point()
            if floating and _differs(b, reference_buffer) or not floating and not torch.equal(b, reference_buffer):
                mismatches.append(f"buffer {name}")
        result["mismatches"] = mismatches
        result["expected_skipped"] = expected_skipped(stage)
        for net in (model, reference):
            net.zero_grad(set_to_none=True)
        results[f"{model_name}-{schedule_name}-{'2bp' if twobp_on else 'plain'}"] = result
    return results


def _all_models(rank: int) -> dict:
    results: dict = {}
    for model_name in MODELS:
        results.update(_check_model(rank, model_name))
    return results


#: Over 20 s on two loaded cores, once for all the settings below: two processes start and
#: import torchvision and transformers, then run 4 models x 3 schedules, each against the whole
#: model in one process. Splitting it up would pay the start-up again per part.
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    directory = tmp_path_factory.mktemp("models")
    store, results = str(directory / "store"), str(directory / "result")
    run_ranks(gloo_rank_main, WORLD, (WORLD, _all_models, store, results), 150.0, ": the pipeline hung")
    return read_results(results, WORLD)


@pytest.mark.parametrize("setting", SETTING_IDS)
def test_pipelined_step_matches_the_model_in_one_process(two_ranks: list[dict], setting: str) -> None:
    model_name = setting.split("-")[0]
    twobp_on = setting.endswith("-2bp")
    for rank, results in enumerate(two_ranks):
        result = results[setting]
        assert not result["mismatches"], f"rank {rank}: {result['mismatches']}"
        if twobp_on:  # a stage that silently kept plain autograd would queue nothing
            assert result["deferred_jobs"] > 0, f"rank {rank}: nothing was deferred"
            assert result["skipped"] == result["expected_skipped"], f"rank {rank}: {result['skipped']}"
        else:
            assert result["deferred_jobs"] == 0
        if model_name in TIED:  # the first and the last rank each hold the tied embedding
            assert len(result["tied"]) == 1, f"rank {rank}: {result['tied']}"
            assert result["tie_partial_before_sync"] == [True], "the tie's sum was not needed: nothing tested"
        else:
            assert result["tied"] == []
    first = two_ranks[0][setting]
    torch.testing.assert_close(first["loss"], first["reference_loss"], rtol=1e-5, atol=1e-6)


# -- tied embeddings with two stages per rank -------------------------------------------------

#: (schedule, 2BP on): the loop puts the embedding (stage 0) on rank 0 and the head (stage 3)
#: on rank 1; the V puts both on rank 0.
MULTI_STAGE_SETTINGS = [(name, on) for name in ("interleaved-1f1b", "zbv") for on in (True, False)]


def _check_tied_multi_stage(rank: int) -> dict:
    """Tiny Llama (embedding, 2 layers, head: 4 blocks) in 4 stages, 2 per rank."""
    results: dict = {}
    for schedule_name, twobp_on in MULTI_STAGE_SETTINGS:
        torch.manual_seed(0)
        model = tiny_llama().train()
        reference = copy.deepcopy(model)
        defer_norms(model)
        owners = placement(schedule_name, WORLD)
        pipeline = split_model(model, len(owners))
        tied = TiedGradients(pipeline, placement=owners)
        mine = {index: pipeline.stages[index] for index, owner in enumerate(owners) if owner == rank}
        m = default_num_micro_batches(schedule_name, WORLD)
        runtime = PipelineRuntime(
            mine, schedule(schedule_name, WORLD, m, twobp_on)[rank], num_micro_batches=m, loss_fn=pipeline.loss_fn,
            twobp=twobp_on, timeout=RUNTIME_TIMEOUT, placement=owners,
        )  # fmt: skip
        inputs, targets = token_batch(torch.Generator().manual_seed(1))
        report = runtime.step(inputs if owners[0] == rank else None, targets if owners[-1] == rank else None)
        own = report.ranks[rank] if isinstance(report, StepReport) else report
        tied.all_reduce()
        for x, y in zip(inputs.tensor_split(m), targets.tensor_split(m), strict=True):
            (hf_loss(reference, x, y) / m).backward()
        names = {id(p): name for name, p in model.named_parameters()}
        reference_params = dict(reference.named_parameters())
        held = {id(p): p for stage in mine.values() for p in stage.parameters()}
        results[f"{schedule_name}-{'2bp' if twobp_on else 'plain'}"] = {
            "mismatches": [names[i] for i, p in held.items() if _differs(p.grad, reference_params[names[i]].grad)],
            "tied_here": [t.name for t in pipeline.ties if any(owners[s] == rank for s in t.stages)],
            "reductions": len(tied.reductions),
            "deferred_jobs": own.deferred_jobs,
        }
    return results


def test_tied_embeddings_with_two_stages_per_rank_match_the_model_in_one_process(tmp_path) -> None:
    store, results = str(tmp_path / "store"), str(tmp_path / "result")
    run_ranks(gloo_rank_main, WORLD, (WORLD, _check_tied_multi_stage, store, results), 120.0, ": the pipeline hung")
    ranks = read_results(results, WORLD)
    tie = "model.embed_tokens.weight"
    for schedule_name, twobp_on in MULTI_STAGE_SETTINGS:
        setting = f"{schedule_name}-{'2bp' if twobp_on else 'plain'}"
        for rank, result in enumerate(r[setting] for r in ranks):
            assert not result["mismatches"], f"{setting}, rank {rank}: {result['mismatches']}"
            assert (result["deferred_jobs"] > 0) == twobp_on, f"{setting}, rank {rank}"
        if schedule_name == "zbv":  # the V's rank 0 holds both uses: nothing to sum
            assert [r[setting]["tied_here"] for r in ranks] == [[tie], []]
            assert [r[setting]["reductions"] for r in ranks] == [0, 0]
        else:
            assert [r[setting]["tied_here"] for r in ranks] == [[tie], [tie]]
            assert [r[setting]["reductions"] for r in ranks] == [1, 1]


def _check_frozen_tie(rank: int) -> dict:
    """Tiny Llama in 2 stages with its tied embedding frozen (fine-tuning the blocks only)."""
    torch.manual_seed(0)
    model = tiny_llama().train()
    model.get_input_embeddings().weight.requires_grad_(False)
    defer_norms(model)
    pipeline = split_model(model, WORLD)
    tied = TiedGradients(pipeline)
    m = default_num_micro_batches("gpipe", WORLD)
    runtime = PipelineRuntime(
        pipeline.stages[rank], schedule("gpipe", WORLD, m, True)[rank], num_micro_batches=m,
        loss_fn=pipeline.loss_fn, timeout=RUNTIME_TIMEOUT,
    )  # fmt: skip
    inputs, targets = token_batch(torch.Generator().manual_seed(1))
    runtime.step(inputs if rank == 0 else None, targets if rank == WORLD - 1 else None)
    tied.all_reduce()
    return {"tie_grads": [t.parameter.grad is None for t in pipeline.ties], "ties": len(pipeline.ties)}


def test_a_frozen_tie_keeps_no_gradient_as_in_plain(tmp_path) -> None:
    """The sum gave a frozen tied embedding a zero .grad where plain leaves None: an optimizer
    built over model.parameters() then moved the frozen weight by its weight decay."""
    store, results = str(tmp_path / "store"), str(tmp_path / "result")
    run_ranks(gloo_rank_main, WORLD, (WORLD, _check_frozen_tie, store, results), 120.0, ": the pipeline hung")
    for rank, result in enumerate(read_results(results, WORLD)):
        assert result["ties"] == 1 and result["tie_grads"] == [True], (rank, result)


def _check_ties_per_replica(rank: int) -> dict:
    """A (dp, pp) = (2, 2) mesh, the tie summed over each replica's pipeline group: every rank's
    own part says which replica and stage it is, so a sum across replicas shows."""
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica, stage = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    sums = []
    for _ in range(3):  # each build makes groups anew: replicas that disagree about them pair up by chance
        pipeline = split_model(tiny_llama(), 2)
        tied = TiedGradients(pipeline, group=mesh.get_group("pp"))
        (tie,) = pipeline.ties
        tie.parameter.grad = torch.full_like(tie.parameter, 10.0 * replica + stage + 1)
        tied.all_reduce()
        sums.append(tie.parameter.grad.unique().tolist())
    return {"sums": sums, "expected": [20.0 * replica + 3]}


def test_ties_on_a_data_parallel_mesh_are_summed_within_each_replica(tmp_path) -> None:
    """Every process must make the same groups in the same order: each replica made only its own
    holders' group, and ranks of different replicas met under one group name (a sum of 13 for 3
    or 23, a hang, or a gloo connection reset)."""
    store, results = str(tmp_path / "store"), str(tmp_path / "result")
    run_ranks(gloo_rank_main, 4, (4, _check_ties_per_replica, store, results), 120.0, ": the reduction hung")
    for rank, result in enumerate(read_results(results, 4)):
        assert result["sums"] == [result["expected"]] * 3, (rank, result)


def _check_a_tie_no_use_reached(rank: int) -> dict:
    """Two stages holding a tie: this step neither rank's use of it got a gradient, the next step
    only the first rank's did."""
    pipeline = split_model(tiny_llama(), WORLD)
    tied = TiedGradients(pipeline)
    (tie,) = pipeline.ties
    tied.all_reduce()
    unreached = tie.parameter.grad is None
    if rank == 0:
        tie.parameter.grad = torch.ones_like(tie.parameter)
    tied.all_reduce()
    return {"unreached": unreached, "one_reached": tie.parameter.grad.unique().tolist()}


def test_a_tie_no_use_reached_keeps_no_gradient_as_in_plain(tmp_path) -> None:
    """A tie in a branch no sample took this step (or frozen for the step): the sum wrote zeros
    into its .grad where plain leaves None, and an optimizer with momentum or weight decay moved
    it."""
    store, results = str(tmp_path / "store"), str(tmp_path / "result")
    run_ranks(gloo_rank_main, WORLD, (WORLD, _check_a_tie_no_use_reached, store, results), 120.0, ": it hung")
    for rank, result in enumerate(read_results(results, WORLD)):
        assert result == {"unreached": True, "one_reached": [1.0]}, (rank, result)


def _check_a_tie_held_alike(rank: int) -> dict:
    """A tie frozen through one holder's stage only, then one holder's gradient sparse (a sparse
    embedding's) beside the other's dense one."""
    pipeline = split_model(tiny_llama(), WORLD)
    tied = TiedGradients(pipeline)
    (tie,) = pipeline.ties
    tie.parameter.requires_grad_(rank != 0)
    tie.parameter.grad = torch.ones_like(tie.parameter)
    try:
        tied.all_reduce()
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    tie.parameter.requires_grad_(True)
    rows = torch.tensor([[0, 1]])
    one = torch.ones(2, tie.parameter.shape[1])
    tie.parameter.grad = torch.sparse_coo_tensor(rows, one, tie.parameter.shape) if rank == 0 else None
    tied.all_reduce()
    grad = tie.parameter.grad
    return {"refused": refused, "sparse_summed": (grad.layout == torch.strided, grad[:3, 0].tolist())}


def test_a_tie_must_be_held_alike_and_sums_a_sparse_part(tmp_path) -> None:
    """A tie frozen on one holder only: that holder skipped the sum alone, and the others' sums
    paired with its next tie's (a wrong sum, then a hang). A sparse part summed with a dense one
    hung in gloo."""
    store, results = str(tmp_path / "store"), str(tmp_path / "result")
    run_ranks(gloo_rank_main, WORLD, (WORLD, _check_a_tie_held_alike, store, results), 120.0, ": it hung")
    for rank, result in enumerate(read_results(results, WORLD)):
        assert "twobp: a tied parameter requires grad on some of the ranks" in result["refused"], (rank, result)
        assert result["sparse_summed"] == (True, [1.0, 1.0, 0.0]), (rank, result)


def test_tied_gradients_refuse_a_placement_of_another_cut() -> None:
    pipeline = split_model(tiny_llama(), 4)
    with pytest.raises(ValueError, match="twobp: a placement of 2 stages for a pipeline of 4"):
        TiedGradients(pipeline, placement=(0, 1))
