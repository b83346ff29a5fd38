"""Real, unchanged models patched whole: torchvision's ResNet-152 trained for a few steps, and
tiny Hugging Face Llama, BERT and Mamba models, each against a plain deep copy.

The Hugging Face RMSNorm classes are not PyTorch's ``nn.RMSNorm``; they are deferred only
once registered through the public API, which these tests do (and check that, before, they
are reported as skipped and keep plain autograd).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import twobp_autograd as twobp
from tests.utils import assert_grads_match

torchvision = pytest.importorskip("torchvision")
transformers = pytest.importorskip("transformers")


# -- ResNet-152: five training steps -------------------------------------------------------

RESNET_STEPS = 5
RESNET_MICRO_BATCHES = 4
RESNET_BATCH = 2
RESNET_SIZE = 32
#: Gradients, norm-wise per parameter (||a - b|| <= rtol * ||b||). 2BP sums a layer's weight
#: gradient over the 4 concatenated micro-batches in one kernel call where plain autograd
#: adds 4 separate sums: the same math in another fp32 order. At 32x32 with batches of 2,
#: layer4's BatchNorms normalise 2 values per channel and layer3's 8, so a rounding-level
#: difference reaches some cancelling entries at ~1e-3 relative, while the gradient as a
#: whole agrees to ~1e-6 (measured: 8e-7). A gradient 0.1% off, or one micro-batch missed,
#: fails.
RESNET_GRAD_RTOL = 2e-5
#: Parameters, buffers and losses, element-wise: one step of lr 0.01 moves a parameter by
#: 0.01 x its gradient, so the gradients' rounding differences leave ~1e-8 absolute.
RESNET_RTOL, RESNET_ATOL = 1e-5, 1e-6


def _resnet_deferred_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (nn.Conv2d, nn.BatchNorm2d, nn.Linear))
    }


def test_resnet152_trains_like_plain_autograd() -> None:
    # zero_init_residual (torchvision's own option) makes every block start as the identity:
    # with the default init and batches of 2, the gradients at the stem reach ~1e13.
    model = torchvision.models.resnet152(num_classes=10, zero_init_residual=True)
    reference = copy.deepcopy(model)
    report = twobp.patch(model, report=True)

    deferred = _resnet_deferred_modules(model)
    assert sum(isinstance(m, nn.Conv2d) for m in deferred.values()) == 155
    assert sum(isinstance(m, nn.BatchNorm2d) for m in deferred.values()) == 155
    assert set(report.patched) == set(deferred), "every conv, bn and the fc must be patched"
    assert report.skipped == {}

    optimizer, reference_optimizer = (
        torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (model, reference)
    )
    for step in range(RESNET_STEPS):
        losses: list[list[float]] = [[], []]
        for micro in range(RESNET_MICRO_BATCHES):
            x = torch.randn(RESNET_BATCH, 3, RESNET_SIZE, RESNET_SIZE)
            y = torch.randint(0, 10, (RESNET_BATCH,))
            for side, net in enumerate((model, reference)):
                loss = F.cross_entropy(net(x), y) / RESNET_MICRO_BATCHES
                loss.backward()
                losses[side].append(loss.item())
            for name, p in model.named_parameters():
                assert p.grad is None, f"step {step}, micro-batch {micro}: {name}.grad written in backward-p1"
        # 155 conv + 155 bn + 1 fc jobs per micro-batch
        assert twobp.pending().jobs == 311 * RESNET_MICRO_BATCHES
        twobp.flush_weight_grads()
        assert twobp.pending() == (0, 0)
        torch.testing.assert_close(losses[0], losses[1], rtol=RESNET_RTOL, atol=RESNET_ATOL)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert p.grad is not None, f"step {step}: {name}.grad is None after the flush"
            error = (p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30)
            assert error <= RESNET_GRAD_RTOL, f"step {step}, {name}: {error:.1e}"

        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference_optimizer.zero_grad(set_to_none=True)
        # Parameters and buffers (BatchNorm's running statistics and batch counts).
        for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
            torch.testing.assert_close(
                a,
                b,
                rtol=RESNET_RTOL,
                atol=RESNET_ATOL,
                msg=lambda m, step=step, name=name: f"step {step}, {name}: {m}",
            )
        # This network at batch 2 is chaotic: a 1e-7 difference in its weights grows ~1e6x
        # per step (measured in fp64 as well: 1e-16 -> 1e-10 -> 1e-6 -> O(1) by step 3), so
        # plain autograd would not reproduce itself after a reordered sum either. Each step
        # therefore starts both models from the same weights and momentum: every step is
        # compared on its own, with all 5 steps' queues, flushes and optimizer state real.
        model.load_state_dict(reference.state_dict())
        # (copied: load_state_dict would share the momentum tensors between the two)
        optimizer.load_state_dict(copy.deepcopy(reference_optimizer.state_dict()))


# -- Hugging Face models: gradients after one flush ----------------------------------------

from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.mamba.modeling_mamba import MambaRMSNorm  # noqa: E402

from tests import tiny_models  # noqa: E402  (after the importorskip above)

VOCAB, HIDDEN, LAYERS, SEQUENCE, BATCH, MICRO_BATCHES = 96, 32, 2, 12, 2, 3


def tiny_llama() -> nn.Module:
    return tiny_models.llama(VOCAB, HIDDEN, LAYERS, SEQUENCE, "sdpa")


def tiny_bert() -> nn.Module:
    return tiny_models.bert(VOCAB, HIDDEN, LAYERS, SEQUENCE)


def tiny_mamba() -> nn.Module:
    return tiny_models.mamba(VOCAB, HIDDEN, LAYERS, state_size=8, conv_kernel=4)


def tiny_mixtral() -> nn.Module:
    """Mixture of experts as transformers 5 builds it: every expert in one 3-D parameter."""
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=SEQUENCE, tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config).train()


#: The experts and their router read their parameters themselves (``self.gate_up_proj[e]``):
#: registered with the recompute rule, as the README says, they defer.
_MIXTRAL_OWN = ("MixtralRMSNorm", "MixtralExperts", "MixtralTopKRouter")

#: MambaMixer's forward reads these parameters itself (``self.A_log``, ``self.D``,
#: ``self.conv1d.weight.squeeze(1)``, ``self.dt_proj.weight @ ...``) instead of calling the
#: submodules, so no patched forward sees them: they stay on plain autograd, computed in
#: backward. Everything the mixer reaches through a module call (in_proj, x_proj, out_proj)
#: is deferred.
MAMBA_IMMEDIATE = (
    "mixer.A_log",
    "mixer.D",
    "mixer.conv1d.weight",
    "mixer.conv1d.bias",
    "mixer.dt_proj.weight",
    "mixer.dt_proj.bias",
)

#: BERT's prediction head holds its decoder's bias as its own attribute as well; the decoder
#: (a patched Linear) is what uses it. MambaMixer holds A_log and D itself.
BERT_SKIPPED = {"cls.predictions"}
MAMBA_SKIPPED = {f"backbone.layers.{i}.mixer" for i in range(LAYERS)}

# (id, model, its own norm classes to register, modules patch skips, params left immediate)
HF_CASES: list[tuple[str, Callable[[], nn.Module], tuple[type, ...], set[str], tuple[str, ...]]] = [
    ("llama-sdpa-tied", tiny_llama, (LlamaRMSNorm,), set(), ()),
    ("bert-eager-tied", tiny_bert, (), BERT_SKIPPED, ()),
    ("mamba-tied", tiny_mamba, (MambaRMSNorm,), MAMBA_SKIPPED, MAMBA_IMMEDIATE),
    (
        "mixtral-experts-tied",
        tiny_mixtral,
        tuple(getattr(transformers.models.mixtral.modeling_mixtral, name) for name in _MIXTRAL_OWN),
        set(),
        (),
    ),
]


def _immediate(name: str, suffixes: tuple[str, ...]) -> bool:
    return any(name.endswith(s) for s in suffixes)


@pytest.mark.parametrize(
    "make_model, norms, skipped, immediate", [c[1:] for c in HF_CASES], ids=[c[0] for c in HF_CASES]
)
def test_hugging_face_model_matches_plain_autograd(
    make_model: Callable[[], nn.Module],
    norms: tuple[type, ...],
    skipped: set[str],
    immediate: tuple[str, ...],
) -> None:
    model = make_model()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "tied embeddings"
    reference = copy.deepcopy(model)

    for norm in norms:  # before registration: reported, left on plain autograd
        report = twobp.patch(copy.deepcopy(model), report=True)
        assert any(type(m) is norm for name, m in model.named_modules() if name in report.skipped)
        # The public way to defer a model's own per-sample layer: its forward re-run at flush.
        twobp.register(norm, twobp.ops.recompute)
    report = twobp.patch(model, report=True)
    assert set(report.skipped) == skipped, str(report)

    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE))
        model(input_ids=ids, labels=ids).loss.backward()
        reference(input_ids=ids.clone(), labels=ids.clone()).loss.backward()

    names = [name for name, _ in model.named_parameters()]
    written = {name for name, p in model.named_parameters() if p.grad is not None}
    expected_immediate = {name for name in names if _immediate(name, immediate)}
    assert written == expected_immediate, "exactly these parameters stay on plain autograd"
    assert twobp.pending().jobs > 0

    twobp.flush_weight_grads()
    assert twobp.pending() == (0, 0)
    assert all(p.grad is not None for p in model.parameters())
    assert_grads_match(model, reference)


@pytest.mark.parametrize("use_reentrant", [None, True], ids=["hugging-face-default", "reentrant"])
def test_hugging_face_activation_checkpointing_matches_plain_autograd(use_reentrant: bool | None) -> None:
    """``activation_checkpointing_enable()`` (non-reentrant by default) and the reentrant kind,
    whose region re-runs its forward inside backward: the backward runs in the forward's
    ``use_queue`` block, so that work joins the same queue."""
    model = tiny_llama()
    reference = copy.deepcopy(model)
    twobp.register(LlamaRMSNorm, twobp.ops.llama_rms_norm)
    twobp.patch(model)
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    for net in (model, reference):
        net.config.use_cache = False
        net.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    queue = twobp.WeightGradQueue()
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE))
        with twobp.use_queue(queue):
            model(input_ids=ids, labels=ids).loss.backward()
        reference(input_ids=ids.clone(), labels=ids.clone()).loss.backward()
    assert queue.pending().jobs > 0 and twobp.pending().jobs == 0
    queue.flush()
    assert_grads_match(model, reference)


# -- Hugging Face Trainer: where the flush goes -------------------------------------------


class _TokenIds(torch.utils.data.Dataset):
    def __init__(self, samples: int) -> None:
        self.ids = torch.randint(0, VOCAB, (samples, SEQUENCE), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def test_hugging_face_trainer_with_the_readme_flush_trains_like_plain(tmp_path) -> None:
    """Trainer clips and steps right after the last micro-batch's ``training_step``: README's
    subclass flushes at its end (``accelerator.sync_gradients``). Without it, clipping is refused."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    class TwoBPTrainer(Trainer):  # as README shows it
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.accelerator.sync_gradients:  # the step's last micro-batch: flush before clipping
                twobp.flush_weight_grads()
            return loss

    model = tiny_llama()
    reference = copy.deepcopy(model)
    twobp.register(LlamaRMSNorm, twobp.ops.llama_rms_norm)
    twobp.patch(model)
    arguments = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        max_grad_norm=0.5, learning_rate=1e-2, seed=0, use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    data = _TokenIds(16)

    with pytest.raises(RuntimeError, match=r"twobp: gradient clipping .* still queued"):
        Trainer(model=copy.deepcopy(model), args=arguments, train_dataset=data).train()
    twobp.discard_weight_grads()

    TwoBPTrainer(model=model, args=arguments, train_dataset=data).train()
    Trainer(model=reference, args=arguments, train_dataset=data).train()
    assert twobp.pending().jobs == 0
    for (name, trained), (_, expected) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(trained, expected, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_an_accelerate_loop_with_the_readme_flush_trains_like_plain() -> None:
    """README's place for the flush in a plain accelerate loop: inside ``accumulate``, on the
    step's last micro-batch, before clipping and the step."""
    accelerate = pytest.importorskip("accelerate")

    def train(patched: bool) -> nn.Module:
        accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
        torch.manual_seed(0)
        model = tiny_llama()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = torch.utils.data.DataLoader(_TokenIds(12), batch_size=2)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        if patched:
            twobp.register(LlamaRMSNorm, twobp.ops.llama_rms_norm)
            twobp.patch(accelerator.unwrap_model(model))
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                if accelerator.sync_gradients:
                    if patched:
                        twobp.flush_weight_grads()
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad()
        return accelerator.unwrap_model(model)

    trained, expected = train(True), train(False)
    assert twobp.pending().jobs == 0
    for (name, p), q in zip(trained.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def _lightning_module(net: nn.Module, flush: bool, log_grad_norms: list[float]) -> Any:
    """A LightningModule over ``net``, with README's flush inside the optimizer closure."""
    lightning = pytest.importorskip("lightning.pytorch")

    class Regression(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            # What a grad-norm logger reads: after the flush, the whole gradient.
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            log_grad_norms.append(float(torch.nn.utils.get_total_norm(grads)))

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any) -> None:
            if not flush:
                return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

            def closure() -> torch.Tensor:  # as README shows it
                loss = optimizer_closure()  # training_step and backward of the step's last micro-batch
                twobp.flush_weight_grads()  # before unscale_, on_before_optimizer_step, clipping
                return loss

            optimizer.step(closure=closure)

    return Regression()


LIGHTNING_SETTINGS = {
    "accumulate-4-clip-norm": dict(accumulate_grad_batches=4, gradient_clip_val=0.5),
    "accumulate-1-clip-value": dict(gradient_clip_val=0.05, gradient_clip_algorithm="value"),
    "bf16-mixed": dict(accumulate_grad_batches=2, precision="bf16-mixed"),
}


@pytest.mark.parametrize("setting", LIGHTNING_SETTINGS.values(), ids=LIGHTNING_SETTINGS.keys())
def test_a_lightning_module_with_the_readme_flush_trains_like_plain(setting: dict[str, Any]) -> None:
    """Lightning owns the loop: README's flush inside the optimizer closure runs after the last
    micro-batch's backward and before every reader of .grad (unscale_, on_before_optimizer_step,
    clipping, the step); accumulated micro-batches stay queued and are joined."""
    lightning = pytest.importorskip("lightning.pytorch")

    def fit(
        patched: bool, setting: dict[str, Any] = setting, flush: bool | None = None
    ) -> tuple[nn.Module, list[float]]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 4))
        if patched:
            twobp.patch(net)
        norms: list[float] = []
        module = _lightning_module(net, patched if flush is None else flush, norms)
        lightning.seed_everything(0, verbose=False)
        x, y = torch.randn(36, 8, generator=torch.Generator().manual_seed(1)), torch.randn(36, 4)
        trainer = lightning.Trainer(
            accelerator="cpu", deterministic=True, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, max_epochs=2, **setting,
        )  # fmt: skip
        trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4))
        return net, norms

    with pytest.raises(RuntimeError, match="twobp: .* still queued"):  # without the flush: refused
        fit(True, flush=False)
    twobp.discard_weight_grads()
    (trained, norms), (expected, expected_norms) = fit(True), fit(False)
    assert twobp.pending().jobs == 0
    if "precision" not in setting:
        torch.testing.assert_close(norms, expected_norms, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(trained.state_dict().items(), expected.state_dict().values(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        return
    # bf16 products round apart (2BP sums in fp32) and AdamW magnifies small gradients' rounding:
    # each run's distance from the fp32 run, 2BP's no more than 1.5x plain's (measured 0.96x).
    exact, _ = fit(False, {k: v for k, v in setting.items() if k != "precision"})

    def distance(net: nn.Module) -> float:
        pairs = zip(net.parameters(), exact.parameters(), strict=True)
        return sum(float((p - q).norm() ** 2) for p, q in pairs) ** 0.5

    assert distance(trained) <= 1.5 * distance(expected), (distance(trained), distance(expected))
