"""TRM and HRM as runner Tasks (the `trm` and `hrm` model families).

`ACTTask`: one call of `train_loss` is one ACT step (deep supervision). The carry (inner
z_H/z_L, steps, halted, the data rows being worked on) persists across batches; halted rows
take the new batch's rows. Loss = `act_loss` total / global batch; metrics come from the rows
that halted this step. Evaluation runs ``halt_max_steps`` steps.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp

from models.attention import IMPLEMENTATIONS
from models.flops import attention_core, matmul, swiglu, trained
from models.layers import check_at_least, check_dtype_names, check_heads
from models.recursive_reasoning.act import act_evaluate, act_step, init_params, initial_carry
from models.recursive_reasoning.hrm import HRM, HRMConfig
from models.recursive_reasoning.layers import ReasoningNet, swiglu_width
from models.recursive_reasoning.losses import LOSS_FNS, act_loss
from models.recursive_reasoning import mixer_kernel
from models.recursive_reasoning.mixer_kernel import FORMS as MIXER_FORMS
from models.recursive_reasoning.trm import POS_ENCODINGS, TRM, TRMConfig, prefix_len
from runtime.errors import UserError
from runtime.registry import ModelFamily, register_model_family
from runtime.task import DataShape, Task


class ACTTask(Task):
    """TRM / HRM with the ACT wrapper (see the module docstring)."""

    has_eval_outputs = True

    def __init__(self, model, exploration=None):
        self.model = model
        self.loss_type = model.cfg.loss_type  # stablemax (the reference's Sudoku/ARC/Maze setting) or softmax
        # > 0: the cycle-consistency term (TRMConfig.cycle_consistency_weight) is in the loss
        self.cycle_weight = float(getattr(model.cfg, "cycle_consistency_weight", 0.0))
        # optional traceable step (int32 array) -> halt exploration probability (an annealed
        # schedule); overrides the arch's halt_exploration_prob when train_loss gets a step
        self.exploration = exploration

    def init(self, rng, example_batch):
        one = {k: v[:1] for k, v in example_batch.items()}
        return init_params(self.model, rng, one)

    def init_carry(self, example_batch):
        return initial_carry(self.model, example_batch)

    def train_loss(self, params, carry, batch, rng, step=None):
        prob = self.exploration(step) if (self.exploration is not None and step is not None) else None
        new_carry, out = act_step(self.model, params, carry, batch, rng, True, exploration_prob=prob)
        total, sums = act_loss(out, new_carry.current_data["labels"], new_carry.halted, new_carry.steps,
                               loss_type=self.loss_type, cycle_weight=self.cycle_weight)
        extras = {"puzzle_identifiers": new_carry.current_data["puzzle_identifiers"]}
        return total / self.loss_denominator(batch), (new_carry, sums, extras)

    def eval_sums(self, params, batch):
        return self.eval_outputs(params, batch)[0]

    def eval_outputs(self, params, batch):
        """(metric sums, per-row outputs): the predictions and q_halt logits, for the ARC evaluator."""
        carry, out = act_evaluate(self.model, params, batch)
        sums = act_loss(out, carry.current_data["labels"], carry.halted, carry.steps, loss_type=self.loss_type,
                        cycle_weight=self.cycle_weight)[1]
        return sums, {"preds": out["logits"].argmax(-1).astype(jnp.int32), "q_halt_logits": out["q_halt_logits"]}

    def summarize(self, sums: Mapping[str, Any], global_batch: int, training: bool) -> dict[str, float]:
        """The reference's normalisation: in training, losses / global batch and the rest / count
        (halted rows with labels); in evaluation everything / count. ``cycle_loss`` (present only
        with the cycle-consistency term) is a loss too; ``loss`` includes it times its weight."""
        s = {k: float(v) for k, v in sums.items()}
        count = max(s["count"], 1.0)
        loss_div = float(global_batch) if training else count
        out = {k: s[k] / loss_div for k in ("lm_loss", "q_halt_loss", "q_continue_loss")}
        out["loss"] = out["lm_loss"] + 0.5 * (out["q_halt_loss"] + out["q_continue_loss"])
        if "cycle_loss" in s:
            out["cycle_loss"] = s["cycle_loss"] / loss_div
            out["loss"] += self.cycle_weight * out["cycle_loss"]
        out |= {"token_accuracy": s["accuracy"] / count, "exact_accuracy": s["exact_accuracy"] / count,
                "q_halt_accuracy": s["q_halt_accuracy"] / count, "steps": s["steps"] / count, "count": s["count"]}
        return out

    def flops_per_example(self, seq_len: int = 0) -> float:
        """Model FLOPs of one row's ACT step (one train step), by `act_step_flops`."""
        return act_step_flops(self.model)


def net_flops(net: ReasoningNet) -> float:
    """Forward matmul FLOPs of one application of a reasoning network to one example.
    Attention is dense (an attention_window mask saves no compute in this implementation)."""
    t, d = net.total_len, net.hidden
    block = swiglu(t, d, swiglu_width(d, net.expansion))
    if net.mlp_t:  # the token-mixing SwiGLU runs over the sequence axis for every feature
        block += swiglu(d, t, swiglu_width(t, net.expansion))
    else:
        block += matmul(t, d, 3 * d) + matmul(t, d, d) + attention_core(t, t, net.heads, d // net.heads)
    return net.layers * block


def act_step_flops(model: Any) -> float:
    """Model FLOPs of one ACT step of one row in training (forward and backward).

    TRM: H_cycles x (L_cycles + 1) network applications forward, of which only the last cycle's
    L_cycles + 1 have a backward; HRM: H_cycles x (L_cycles L-net + 1 H-net) forward, of which
    the last L- and H-updates have a backward. The heads (LM over the sequence, Q over one
    position) train; with Q-continue (no_ACT_continue=False) a second inner call without
    gradient runs for the bootstrapped target (its LM logits are unused, so not counted).
    """
    cfg = model.cfg
    head_q = matmul(1, cfg.hidden, 2)
    heads = matmul(model.seq_len, cfg.hidden, model.vocab_size) + head_q
    if isinstance(model, HRM):
        f_h, f_l = net_flops(model._net_def(cfg.H_layers)), net_flops(model._net_def(cfg.L_layers))
        forward, with_grad = cfg.H_cycles * (cfg.L_cycles * f_l + f_h), f_l + f_h
    else:
        f_net = net_flops(model._net_def(cfg.L_layers))
        forward, with_grad = cfg.H_cycles * (cfg.L_cycles + 1) * f_net, (cfg.L_cycles + 1) * f_net
    total = forward - with_grad + trained(with_grad + heads)
    if cfg.halt_max_steps > 1 and not cfg.no_ACT_continue:
        total += forward + head_q
    return total


def init_state_vectors(init_states: Any) -> tuple | None:
    """(H_init, L_init) as hashable tuples (a module field) from the imported or checkpointed
    form: {"H_init": [...], "L_init": [...]} or [[...], [...]]."""
    if init_states is None:
        return None
    if isinstance(init_states, Mapping):
        init_states = (init_states["H_init"], init_states["L_init"])
    return tuple(tuple(float(x) for x in v) for v in init_states)


def build_model(arch: Any, shape: DataShape, init_states: Any = None):
    """The TRM or HRM module of `arch` for a dataset of `shape`."""
    module = TRM if isinstance(arch, TRMConfig) else HRM
    return module(arch, vocab_size=shape.vocab_size, seq_len=shape.seq_len,
                  num_puzzle_identifiers=shape.num_puzzle_identifiers, init_states=init_state_vectors(init_states))


def build_task(arch: Any, shape: DataShape, *, init_states: Any = None, exploration=None, global_batch: int = 0,
               **_: Any) -> Task:
    """An `ACTTask`, or for a mixture of datasets (shape.tasks) the shared-core `MultiTaskACT`."""
    if shape.tasks:
        from models.multitask import build_multitask  # a cycle: models.multitask imports this module

        return build_multitask(arch, shape, global_batch, init_states=init_states, exploration=exploration)
    return ACTTask(build_model(arch, shape, init_states), exploration=exploration)


def absent_part(arch: Any) -> str | None:
    """The problem when a form setting names a part this TRM does not have: `arch.attention` on the
    mlp_t variant (its sequence mixer is a SwiGLU, there is no attention), `arch.mixer` on the
    attention variant (no mlp_t mixer), `arch.grid_width` without a local window to shape. A form
    left at its default (`auto`; null) is no setting."""
    if not isinstance(arch, TRMConfig):  # HRM has attention only; its schema has no mixer
        return None
    if arch.mlp_t and arch.attention != "auto":
        return (f"arch.attention={arch.attention!r}: this TRM (arch.mlp_t=true) has no attention, its sequence mixer "
                "is the mlp_t SwiGLU; drop the setting, or use arch=trm_att (arch.mlp_t=false) for attention")
    if not arch.mlp_t and arch.mixer != "auto":
        return (f"arch.mixer={arch.mixer!r}: this TRM (arch.mlp_t=false) mixes the sequence with attention and has no "
                "mlp_t mixer; drop the setting, or use arch=trm_mlp (arch.mlp_t=true) for the mixer")
    if arch.grid_width is not None and arch.attention_window is None:
        return (f"arch.grid_width={arch.grid_width} shapes the local attention window, and arch.attention_window is "
                "not set; drop arch.grid_width, or set arch.attention_window")
    return None


def check_platform(arch: Any, platform: str, shape: DataShape) -> None:
    """An explicit `arch.mixer=pallas` that `auto` would not choose on `platform` because the
    kernel cannot take it: refused in one line before anything compiles, naming the forms that
    work (Mosaic's own error comes mid-compile as a crash, exit 1, which a supervisor relaunches).
    The compute dtype is resolved by now (runtime/config.py resolve_compute_dtype)."""
    if getattr(arch, "mixer", "auto") != "pallas":
        return
    length = prefix_len(arch.puzzle_emb_len, arch.puzzle_emb_ndim, arch.hidden) + shape.seq_len
    width = swiglu_width(length, arch.expansion)
    if mixer_kernel.column_tile(arch.hidden, width) is None:
        raise UserError(f"arch.mixer=pallas: the kernel's working set for a mixer of width {width} (sequence of "
                        f"{length} with prefix, arch.expansion={arch.expansion:g}) on arch.hidden={arch.hidden} "
                        f"features does not fit its VMEM budget on any column tile; use arch.mixer=auto or xla")
    kernel_dtypes = [jnp.dtype(d).name for d in mixer_kernel.DTYPES]
    if platform == "tpu" and jnp.dtype(arch.forward_dtype).name not in kernel_dtypes:
        raise UserError(f"arch.mixer=pallas cannot run arch.forward_dtype={arch.forward_dtype} on TPU (Mosaic cannot "
                        f"lay out its loads); use arch.mixer=auto or xla, or arch.forward_dtype="
                        f"{' or '.join(kernel_dtypes)}")


def validate(arch: Any) -> None:
    if arch.loss_type not in LOSS_FNS:
        raise UserError(f"arch.loss_type={arch.loss_type!r} is not one of {sorted(LOSS_FNS)}")
    if arch.pos_encodings not in POS_ENCODINGS:
        raise UserError(f"arch.pos_encodings={arch.pos_encodings!r} is not one of {list(POS_ENCODINGS)}")
    layers = ("H_layers", "L_layers") if isinstance(arch, HRMConfig) else ("L_layers",)
    check_at_least(arch, 1, "hidden", "heads", *layers, "H_cycles", "L_cycles", "halt_max_steps")
    check_at_least(arch, 0, "puzzle_emb_ndim", *(("puzzle_emb_len",) if isinstance(arch, TRMConfig) else ()))
    check_heads(arch)
    check_dtype_names(arch, "forward_dtype", auto=True)
    if not arch.expansion > 0 or not 0 <= arch.halt_exploration_prob <= 1:
        raise UserError(f"arch.expansion={arch.expansion} must be > 0 and arch.halt_exploration_prob="
                        f"{arch.halt_exploration_prob} in [0, 1]")
    if arch.attention not in IMPLEMENTATIONS:
        raise UserError(f"arch.attention={arch.attention!r} is not one of {list(IMPLEMENTATIONS)}")
    if getattr(arch, "mixer", "xla") not in MIXER_FORMS:
        raise UserError(f"arch.mixer={arch.mixer!r} is not one of {list(MIXER_FORMS)}")
    absent = absent_part(arch)
    if absent:
        raise UserError(absent)
    window = getattr(arch, "attention_window", None)
    if window is not None and (window < 1 or window % 2 == 0 or arch.mlp_t):
        raise UserError(f"arch.attention_window={window} must be a positive odd side length, with arch.mlp_t=false "
                        "(the attention variant); or null for full attention")


register_model_family(ModelFamily("trm", TRMConfig, build_task, validate, compute_dtype="forward_dtype",
                                  forms=("attention", "recompute_mlp", "mixer"), check_platform=check_platform))
register_model_family(ModelFamily("hrm", HRMConfig, build_task, validate, compute_dtype="forward_dtype",
                                  forms=("attention", "recompute_mlp")))
