"""Distil a small draft for any Whisper target, made for speculative decoding: decoder-only (distil-whisper style),
or feature-conditioned (EAGLE style: `asr_spec.models.feature_draft`, `TrainConfig.kind`).

The cache and window packing live in `asr_spec.distill.data`; the saved format in `asr_spec.models.drafts`.

The data path: audio windows → target encoder → the target's own greedy transcript (pseudo-labels, via the
`Engine`) → an on-disk cache (memory-mapped numpy) → a `WhisperForCausalLM` draft trained on the cache with KL to
the target's token distribution + cross-entropy on the pseudo-labels → a transformers directory the `Engine` uses.

What the draft shares with the target and never trains: the token embeddings (also its tied output head) and the
position table. Only its decoder layers and final LayerNorm are trained and saved, so a saved draft is a few MB
per layer and is loaded with `load_trained_draft(dir, target)`, which ties the shared tensors back in.

Teacher logits: the target's final (LayerNormed) decoder hidden state, teacher-forced on the pseudo-labels, is
computed once when the cache is built and stored (width d_model per token); each step's logits are that state
times the output head. This gives exactly the target's teacher-forced logits while saving a full target decoder
pass per window per epoch (on 2 CPU cores the target's cross-attention projections of 1500 frames dominate).

Restricted head: a draft may score only a subset of the vocabulary (`draft_vocab_ids`); the engine fills the
rest with -inf. Training then uses the teacher's distribution renormalised over that subset.

A feature-conditioned draft reads the same stored states: teacher-forced, its input at position t is the target's
state at t - 1 (`feature_draft.shift_features`), and its loss is EAGLE's (Li et al., 2024, eq. 1-3): a feature
regression, smooth L1 between its guess of the state at t and the target's, plus the token cross-entropy against
the target's distribution from that state (the KL term below: the same gradient), optionally the pseudo-label CE:

    loss = reg_weight * SmoothL1(guess_t, state_t) + kl_weight * T^2 * KL(teacher_T || draft_T) + ce_weight * CE

EAGLE uses reg 1 and 0.1 on the token term, with uniform noise on the input states (`feature_noise`: U(-a, a)),
which stands in for the draft's own guesses it reads past its first proposal.

A feature-conditioned draft may start from a plain distilled draft with as many layers (`--init-draft`: its layers,
LayerNorm and head, fc = [0 | I], so it starts proposing exactly what that draft proposes). The target's states are
far larger than its embeddings (whisper-base: RMS 13.2 against 0.028), so at the layers' rate Adam's first steps on
fc's state columns swamp the layers' input (measured: the loss of a warm start went from 0.75 to 6.7 in 12 steps);
`projection_lr_scale` gives fc its own share of the rate (0.002 evens the two halves of its input).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asr_spec.distill.data import (
    CacheBatch,
    CacheUnion,
    PseudoLabelCache,
    comparable_identity,
    first_difference,
    target_identity,
)
from asr_spec.distill.evaluation import draft_states, engine_tokens_per_pass, evaluate_agreement, reads_features
from asr_spec.models.drafts import DECODER_KIND, SHARED_PREFIXES, decoder_draft, tie_shared
from asr_spec.models.feature_draft import KIND as FEATURE_KIND
from asr_spec.models.feature_draft import init_feature_draft

FEATURE_PROJECTION = "model.decoder.fc."  # a feature-conditioned draft's input projection, by parameter name



# -- the draft --------------------------------------------------------------------------------------------------

def init_draft(target: nn.Module, layers: Sequence[int] | None = None, kind: str = DECODER_KIND) -> Any:
    """A `WhisperForCausalLM` draft from target decoder `layers` (default first and last: distil-whisper's init),
    its embeddings, position table and output head *the target's own tensors*, frozen; of kind "target-features",
    a feature-conditioned draft of those layers (default the first: `init_feature_draft`)."""
    if kind == FEATURE_KIND:
        return init_feature_draft(target, layers)
    n = target.config.decoder_layers
    draft = decoder_draft(target, list(layers) if layers is not None else default_layers(n, kind))
    tie_shared(draft, target)
    return draft


def default_layers(n_layers: int, kind: str) -> list[int]:
    """The target layers a draft starts from when none are given: the first and last (decoder-only), the first
    (feature-conditioned: `init_feature_draft`, which says why)."""
    return [0] if kind == FEATURE_KIND else sorted({0, n_layers - 1})


def trainable_parameters(draft: nn.Module) -> dict[str, nn.Parameter]:
    return {k: p for k, p in draft.named_parameters() if not k.startswith(SHARED_PREFIXES)}


def train_vocab(vocab_size: int, suppress: Sequence[int], draft_vocab: torch.Tensor | None) -> torch.Tensor:
    """Token ids the losses are computed over: the draft's vocabulary (all by default) minus suppressed tokens,
    which Whisper's rules forbid anyway (so neither model's mass on them matters)."""
    ids = torch.arange(vocab_size) if draft_vocab is None else draft_vocab.sort().values
    return ids[~torch.isin(ids, torch.tensor(list(suppress), dtype=torch.long))]


def choose_draft_vocab(counts: np.ndarray, size: int, eot: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` ids a restricted draft head scores: every token seen in the pseudo-labels (most frequent first),
    then the lowest remaining text ids (GPT-2 BPE ids follow merge order, a proxy for frequency). Sorted."""
    seen = [int(i) for i in np.argsort(-counts, kind="stable") if counts[i] > 0]
    chosen = dict.fromkeys([eot, *always, *seen][:size])
    for i in range(eot):
        if len(chosen) >= size:
            break
        chosen.setdefault(i, None)
    return torch.tensor(sorted(chosen), dtype=torch.long)


# -- training ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainConfig:
    """One distillation run. The loss per generated token is kl_weight * T^2 * KL(teacher_T || draft_T)
    + ce_weight * CE(draft, pseudo-label), both over the draft's vocabulary minus suppressed tokens; for a
    feature-conditioned draft plus reg_weight * SmoothL1 of its guessed states (module docstring)."""

    kind: str = DECODER_KIND  # "decoder" or "target-features" (asr_spec.models.feature_draft)
    steps: int = 1000
    batch_windows: int = 4  # windows per optimiser step
    lr: float = 3e-4
    warmup_steps: int = 30
    weight_decay: float = 0.01
    kl_weight: float = 1.0
    ce_weight: float = 1.0
    temperature: float = 1.0
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 50  # steps between held-out agreement checks (0 = never)
    ckpt_every: int = 50  # steps between checkpoints (0 = only at the end)
    reg_weight: float | None = None  # feature regression (target-features only; None: 1.0 there)
    feature_noise: float = 0.0  # U(-a, a) noise on the input states in training (target-features only)
    # the input projection's learning rate as a share of lr (target-features only): the target's final states are
    # ~500x larger than its token embeddings on whisper-base (RMS 13.2 vs 0.028), so at lr an Adam step on the
    # state's columns moves the layers' input ~500x more than one on the embedding's (`projection_lr_scale` below)
    projection_lr_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in (DECODER_KIND, FEATURE_KIND):
            raise ValueError(f"kind must be {DECODER_KIND} or {FEATURE_KIND}, got {self.kind!r}")
        if self.kind == DECODER_KIND and (self.reg_weight is not None or self.feature_noise
                                          or self.projection_lr_scale != 1.0):
            raise ValueError("reg_weight, feature_noise and projection_lr_scale apply to target-features drafts only")
        if self.projection_lr_scale <= 0:
            raise ValueError(f"projection_lr_scale must be > 0, got {self.projection_lr_scale}")
        if self.feature_noise < 0 or (self.reg_weight is not None and self.reg_weight < 0):
            raise ValueError("reg_weight and feature_noise must be >= 0")
        for name in ("steps", "batch_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "ckpt_every", "kl_weight", "ce_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.kl_weight and not self.ce_weight:
            raise ValueError("kl_weight and ce_weight are both 0: nothing to train on")
        if self.lr <= 0 or self.temperature <= 0:
            raise ValueError("lr and temperature must be > 0")


@dataclass
class TrainResult:
    draft: Any
    history: list[dict] = field(default_factory=list)  # one entry per eval/ckpt point: step, loss, agreement
    step: int = 0  # steps done in all (a resumed run's included)
    steps: int = 0  # steps the run is for (TrainConfig.steps)

    @property
    def finished(self) -> bool:
        """Whether every step of the run is done (not stopped early by `stop_after`)."""
        return self.step >= self.steps


def batch_indices(step: int, n: int, batch: int, seed: int) -> list[int]:
    """Windows of optimiser step `step`: a stream of per-epoch permutations (seeded by seed and epoch), cut into
    batches; a pure function of its arguments, so a resumed run sees exactly the batches it would have seen."""
    out: list[int] = []
    pos = step * batch
    while len(out) < batch:
        epoch, offset = divmod(pos, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        take = perm[offset: offset + batch - len(out)]
        out.extend(take)
        pos += len(take)
    return out


def loss_on_batch(draft: nn.Module, head: torch.Tensor, vocab: torch.Tensor, b: CacheBatch,
                  cfg: TrainConfig) -> tuple[torch.Tensor, int]:
    """Mean loss over the batch's generated tokens, and their number. head: the (V, d) output head."""
    mask = b.labels != -100
    inputs = b
    if cfg.kind == FEATURE_KIND and cfg.feature_noise:  # noisy input states; the loss's targets stay b's
        noise = (torch.rand_like(b.teacher_hidden) * 2 - 1) * cfg.feature_noise
        inputs = dataclasses.replace(b, teacher_hidden=b.teacher_hidden + noise)
    h = draft_states(draft, inputs)[mask]  # (n, d)
    w = head[vocab]
    s_logits = h @ w.T
    with torch.no_grad():
        t_logits = b.teacher_hidden[mask].to(w.dtype) @ w.T
    tau = cfg.temperature
    t_logp = F.log_softmax(t_logits / tau, -1)
    s_logp = F.log_softmax(s_logits / tau, -1)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean() * tau * tau
    # labels outside a restricted vocabulary cannot be predicted: CE only where the label is in it
    pos = torch.searchsorted(vocab, b.labels[mask]).clamp(max=len(vocab) - 1)
    ok = vocab[pos] == b.labels[mask]
    ce = F.cross_entropy(s_logits[ok], pos[ok]) if bool(ok.any()) else s_logits.sum() * 0
    loss = cfg.kl_weight * kl + cfg.ce_weight * ce
    if cfg.kind == FEATURE_KIND:  # EAGLE's feature regression onto the target's own state at each position
        reg = 1.0 if cfg.reg_weight is None else cfg.reg_weight
        loss = loss + reg * F.smooth_l1_loss(h, b.teacher_hidden[mask].to(h.dtype))
    return loss, int(mask.sum())


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


def param_groups(params: dict[str, nn.Parameter], cfg: TrainConfig) -> list[dict[str, Any]]:
    """The optimiser's parameter groups, each with its "lr_scale" (a share of the schedule's lr): the input
    projection of a feature-conditioned draft at cfg.projection_lr_scale, everything else at 1."""
    projection = [p for k, p in params.items() if k.startswith(FEATURE_PROJECTION)]
    rest = [p for k, p in params.items() if not k.startswith(FEATURE_PROJECTION)]
    groups = [dict(params=rest, lr_scale=1.0)]
    if projection:
        groups.append(dict(params=projection, lr_scale=cfg.projection_lr_scale))
    return groups


def _resume(ckpt_path: Path, key: dict[str, Any], draft: nn.Module,
            opt: torch.optim.Optimizer) -> tuple[int, list[dict]]:
    """Load a checkpoint of the same run into `draft` and `opt`; returns (step, history). `key`: what the checkpoint
    must hold (`_run_key`); one recorded before some of it was (no "target", "data") is compared on the rest.
    ValueError naming the first field that differs."""
    state = torch.load(ckpt_path, weights_only=True)  # tensors and plain data only: no pickled code
    if "head_size" not in state:  # recorded before the head size was: the head it holds
        state["head_size"] = None if state.get("draft_vocab") is None else len(state["draft_vocab"])
    wanted = {name: value for name, value in key.items() if name in state}
    if "target" in wanted:
        wanted["target"] = comparable_identity(state["target"], key["target"])
    diff = first_difference(state, wanted)
    if diff is not None:
        raise ValueError(f"{ckpt_path}: checkpoint of a different run ({diff}); use a new work folder or delete it")
    draft.load_state_dict(state["trainable"], strict=False)
    opt.load_state_dict(state["optim"])
    draft.draft_vocab_ids = state["draft_vocab"]
    return state["step"], state["history"]


def _run_key(target: nn.Module, target_name: str | None, train: PseudoLabelCache | CacheUnion, cfg: TrainConfig,
             layer_ids: list[int], draft_vocab: torch.Tensor | None,
             init_from: str | os.PathLike | None) -> dict[str, Any]:
    """What a checkpoint records of its run and a resumed run must match: the config, the target layers the draft
    started from, the target (`target_identity`), the training caches (`fingerprint`: their meta.json), the head
    asked for (its size, None: as the target's or the initial draft's) and the draft it started from (a checkpoint
    resumed with another size or start kept its own head and layers, whatever --vocab-size or --init-draft said)."""
    return {"config": asdict(cfg), "layers": layer_ids, "target": target_identity(target, target_name),
            "data": train.fingerprint(), "head_size": None if draft_vocab is None else len(draft_vocab),
            "init_draft": None if init_from is None else str(Path(init_from).resolve())}


def _history_point(target: nn.Module, draft: nn.Module, held_out: PseudoLabelCache | None, cfg: TrainConfig,
                   step: int, loss: float) -> dict | None:
    """The history entry of `step`: the loss every eval_every steps, with held-out agreement when there is a held-out
    cache (and at the last step); None between them."""
    if not cfg.eval_every or (step % cfg.eval_every and (held_out is None or step != cfg.steps)):
        return None
    if held_out is None:
        return dict(step=step, loss=loss)
    draft.eval()
    rep = evaluate_agreement(target, draft, held_out)
    if reads_features(draft):  # its simulated counts are upper bounds (evaluation's doc): the engine's own instead
        point = dict(step=step, loss=loss, agreement=rep.agreement,
                     engine_k4=engine_tokens_per_pass(target, draft, held_out, 4))
    else:
        point = dict(step=step, loss=loss, agreement=rep.agreement, accepted_k4=rep.accepted_per_step[4],
                     accepted_k8=rep.accepted_per_step[8])
    draft.train()
    return point


def _init_from_draft(draft: nn.Module, params: dict[str, nn.Parameter], target: nn.Module,
                     path: str | os.PathLike) -> torch.Tensor | None:
    """Copy a saved draft's own (trainable) weights into `draft`; returns its restricted vocabulary (None: full).
    ValueError when its layers do not fit.

    A feature-conditioned draft may start from a plain distilled draft with as many layers (a warm start): its
    layers and final LayerNorm are copied and fc stays [0 | I], so before training it proposes exactly what that
    draft proposes, and training opens the target state's channel (`warm_start_extra`)."""
    from asr_spec.models.loading import load_distilled

    source = load_distilled(path, target)
    src = trainable_parameters(source)
    extra = warm_start_extra(set(params), set(src))
    if extra is None or any(src[k].shape != params[k].shape for k in src):
        raise ValueError(f"--init-draft {path}: its layers do not match the draft being trained "
                         f"({len(src)} tensors against {len(params)}; give --layers with as many layers)")
    with torch.no_grad():
        for k, t in src.items():
            params[k].copy_(t.to(params[k].dtype))
    return getattr(source, "draft_vocab_ids", None)


def warm_start_extra(draft_names: set[str], source_names: set[str]) -> set[str] | None:
    """The draft's tensors a saved draft does not provide: none for a draft of its own kind, the input projection
    (fc) for a feature-conditioned draft started from a plain one; None when the source does not fit (it has a
    tensor the draft lacks, or lacks anything else)."""
    if not source_names <= draft_names:
        return None
    extra = draft_names - source_names
    if any(not name.startswith(FEATURE_PROJECTION) for name in extra):
        return None
    return extra


def _save_checkpoint(ckpt_path: Path, step: int, key: dict[str, Any], history: list[dict], draft: nn.Module,
                     params: dict[str, nn.Parameter], opt: torch.optim.Optimizer) -> None:
    """Write the checkpoint atomically (temporary file, then rename); `key`: `_run_key`."""
    tmp = ckpt_path.with_suffix(".tmp")
    torch.save(dict(step=step, **key, history=history,
                    draft_vocab=draft.draft_vocab_ids,
                    trainable={k: p.detach().clone() for k, p in params.items()},
                    optim=opt.state_dict()), tmp)
    tmp.replace(ckpt_path)


@dataclass
class _Training:
    """What the training loop updates: the draft, its optimiser and where it stands."""

    draft: nn.Module
    params: dict[str, torch.nn.Parameter]  # the draft's trainable parameters, by name
    opt: torch.optim.Optimizer
    vocab: torch.Tensor  # the token ids the losses are computed over (see train_vocab)
    key: dict[str, Any]  # what its checkpoints record and a resumed run must match (`_run_key`)
    step: int = 0  # steps done
    history: list[dict[str, Any]] = field(default_factory=list)
    running: float | None = None  # running mean of the loss (0.9 decay); None before the first step


def _start_training(target: nn.Module, cfg: TrainConfig, ckpt_path: Path, key: dict[str, Any],
                    draft_vocab: torch.Tensor | None, init_from: str | os.PathLike | None) -> _Training:
    """A fresh draft (from the target's layers key["layers"], or `init_from`'s) and its optimiser, or both resumed
    from `ckpt_path` when it exists (a checkpoint of the run `key` describes)."""
    torch.manual_seed(cfg.seed)
    draft = init_draft(target, key["layers"], cfg.kind)
    draft.draft_vocab_ids = draft_vocab
    params = trainable_parameters(draft)
    if init_from is not None and not ckpt_path.is_file():
        source_vocab = _init_from_draft(draft, params, target, init_from)
        if draft_vocab is None and source_vocab is not None:  # the head its layers were trained for
            draft.draft_vocab_ids = draft_vocab = source_vocab.cpu()
    opt = torch.optim.AdamW(param_groups(params, cfg), lr=cfg.lr, weight_decay=cfg.weight_decay)
    suppress = target.generation_config.suppress_tokens or ()
    run = _Training(draft, params, opt, train_vocab(target.config.vocab_size, suppress, draft_vocab), key)
    if ckpt_path.is_file():
        run.step, run.history = _resume(ckpt_path, key, draft, opt)
        run.vocab = train_vocab(target.config.vocab_size, suppress, draft.draft_vocab_ids)
    return run


def _train_step(run: _Training, head: torch.Tensor, train: PseudoLabelCache | CacheUnion, cfg: TrainConfig) -> None:
    """One optimiser step on the batch of windows `batch_indices` picks for `run.step`; the running loss updated."""
    for group in run.opt.param_groups:
        group["lr"] = _lr_at(run.step, cfg) * group["lr_scale"]
    batch = train.batch(batch_indices(run.step, len(train), cfg.batch_windows, cfg.seed))
    loss, _ = loss_on_batch(run.draft, head, run.vocab, batch, cfg)
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(run.params.values()), cfg.grad_clip)
    run.opt.step()
    run.step += 1
    value = float(loss.detach())
    if run.running is None:
        run.running = value
    else:
        run.running = 0.9 * run.running + 0.1 * value


def train_draft(
    target: nn.Module, train: PseudoLabelCache | CacheUnion, cfg: TrainConfig, *, work_dir: str | os.PathLike,
    layers: Sequence[int] | None = None, draft_vocab: torch.Tensor | None = None,
    held_out: PseudoLabelCache | None = None, stop_after: int | None = None, progress: bool = True,
    init_from: str | os.PathLike | None = None, target_name: str | None = None,
) -> TrainResult:
    """Train a draft on `train` (a cache, or a `CacheUnion` of several); resumes from `work_dir/ckpt.pt` when it
    exists (same config, layers, target and caches required: `_run_key`).

    stop_after: stop (with a checkpoint) once this many steps are done in total — for time-boxed runs and tests
        (the result is then not `finished`).
    init_from: start from the layers of a draft saved by `save_trained_draft` (same number of layers) instead of
        the target's layers `layers` (e.g. to teach a trained draft another decoding mode).
    target_name: the name `target` was loaded by, compared with the one the caches record (`check_target`).
    InputError when a cache was labelled by another target; ValueError when work_dir holds another run's checkpoint.
    """
    from tqdm import tqdm

    for cache in (train, held_out):
        if cache is not None:
            cache.check_target(target, target_name)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path = work / "ckpt.pt"
    layer_ids = list(layers) if layers is not None else default_layers(target.config.decoder_layers, cfg.kind)
    key = _run_key(target, target_name, train, cfg, layer_ids, draft_vocab, init_from)
    run = _start_training(target, cfg, ckpt_path, key, draft_vocab, init_from)
    head = target.proj_out.weight
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    bar = tqdm(total=cfg.steps, initial=run.step, desc="distil", disable=not progress)
    run.draft.train()
    while run.step < end:
        _train_step(run, head, train, cfg)
        post = {"loss": f"{run.running:.3f}"}
        point = _history_point(target, run.draft, held_out, cfg, run.step, run.running)
        if point is not None:
            run.history.append(point)
            if "agreement" in point:
                post["agree"] = f"{point['agreement']:.3f}"
        bar.set_postfix(post)
        bar.update(1)
        if (cfg.ckpt_every and run.step % cfg.ckpt_every == 0) or run.step == end:
            _save_checkpoint(ckpt_path, run.step, run.key, run.history, run.draft, run.params, run.opt)
    bar.close()
    run.draft.eval()
    return TrainResult(run.draft, run.history, run.step, cfg.steps)
