"""strata.Engine: a PyTorch model trained on Strata's engine (see docs/python.md).

The model's parameters leave it at initialize(): each becomes an empty placeholder and its
values go to the engine's tiers. Every unit (see _groups.py) gathers its groups before
its forward and releases them after; backward gathers a group again when autograd first
needs one of its saved tensors, and the unit's gradients go into the engine's gradient
buffer when its GatherFn node runs (_autograd.py). step() is the engine's optimizer stage.

Per group and micro-batch the engine keeps:
  flat        the gathered memory as a tensor, or None
  open        unit forwards running with it
  refs        saved tensors that point into it and have not been unpacked
  holds       backward-time uses whose GatherFn has not run (their saved tensors are
              autograd's own, invisible to refs: a recompute's, under checkpointing)
  expected    forward uses whose gradients have not all arrived; 0 -> grads_ready
A group gathered in backward is released once open, refs and holds are all 0 — at the
next unit forward, GatherFn backward, gather or the end of backward, never inside the
unpack that dropped refs to 0, since the op that unpacked it is about to read it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils import dlpack

from . import _autograd, _groups, _pieced, _work
from ._config import config_text
from ._device import move_buffers
from ._strata import Session, StrataError

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {d: n for n, d in _DTYPES.items()}


class _Group:
    __slots__ = ("id", "name", "trainable", "pieces", "layout", "flat", "open", "refs", "holds", "expected",
                 "grads", "ready", "written", "gaps")

    def __init__(self, gid: int, plan: _groups.GroupPlan, layout: dict):
        self.id = gid
        self.name = plan.name
        self.trainable = plan.trainable
        self.pieces = plan.pieces
        self.layout = layout  # tensors: (name, shape, offset, numel)
        self.flat: Optional[torch.Tensor] = None
        self.open = 0
        self.refs = 0
        self.holds = 0
        self.expected = 0
        self.grads: Optional[torch.Tensor] = None
        self.ready = False
        self.written: set = set()  # tensors with a gradient in this micro-batch's buffer
        self.gaps = _gaps(layout)  # [begin, end) ranges of the flat buffer no tensor covers (padding)

    def tensor(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        _, shape, offset, numel = self.layout["tensors"][index]
        return flat[offset:offset + numel].view(shape)

    def holds_memory_of(self, t: torch.Tensor) -> bool:
        flat = self.flat
        if flat is None or t.dtype != flat.dtype or t.device != flat.device:
            return False
        begin = flat.data_ptr()
        return begin <= t.data_ptr() < begin + flat.numel() * flat.element_size()


def _gaps(layout: dict) -> List[tuple]:
    gaps, end = [], 0
    for _, _, offset, numel in sorted(layout["tensors"], key=lambda t: t[2]):
        if offset > end:
            gaps.append((end, offset))
        end = max(end, offset + numel)
    if layout["padded_numel"] > end:
        gaps.append((end, layout["padded_numel"]))
    return gaps


_ADD_CHUNK_ELEMENTS = 1 << 22


def _add_into(target: torch.Tensor, part: torch.Tensor) -> None:
    """target += part. A gradient of another dtype (bf16 into the fp32 buffer) is added in
    row ranges: PyTorch converts the whole operand first, so a vocabulary-sized gradient
    would need a second fp32 copy of itself for the moment."""
    rows = target.shape[0] if target.dim() > 0 else 1
    per_row = max(1, target.numel() // max(1, rows))
    if part.dtype == target.dtype or target.numel() <= _ADD_CHUNK_ELEMENTS or rows < 2:
        target.add_(part)
        return
    step = max(1, _ADD_CHUNK_ELEMENTS // per_row)
    for r in range(0, rows, step):
        target[r:r + step].add_(part[r:r + step])


class Engine:
    """What strata.initialize returns. Call it as the model; then backward(loss), step()."""

    def __init__(self, model: nn.Module, config: Any, groups: _groups.GroupsArg = None,
                 weight_decay: Optional[Any] = None, max_group_elements: int = 1 << 26, seq_len: Optional[int] = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        text, source = config_text(config, model)
        self.module = model
        self._session = Session(text, source)
        self.device = torch.device(self._session.device)
        self._units = _groups.plan_units(model, groups)
        plans, self._where = _groups.plan_groups(model, self._units, max_group_elements)
        if not plans:
            raise StrataError("the model has no parameters: there is nothing to train")
        self._dtype = _DTYPES[self._session.param_dtype]
        self._check_parameters(plans)
        for plan in plans:
            decay = weight_decay or (lambda name, p: True)
            self._session.register_group(plan.name, [(piece.label, piece.shape, bool(decay(piece.name, piece.param)))
                                                     for piece in plan.pieces], plan.trainable,
                                         _DTYPE_NAMES[plan.dtype or self._dtype])
        self._session.declare_held_gradients(self._shared_trainable_groups(plans))
        if self._session.placement_auto:
            self._session.declare_work(*_work.model_work(model, seq_len))
        self._session.start()
        self._groups = [_Group(i, plan, self._session.layout(i)) for i, plan in enumerate(plans)]
        self._params = list({id(piece.param): piece.param for g in self._groups for piece in g.pieces}.values())
        self._needs_load = any(p.is_meta for p in self._params)
        if not self._needs_load:
            self._write_model_values()
        self._take_parameters()
        self._install_hooks()
        self._phase = "idle"          # idle | forward (a training forward ran) | backward (done)
        self._eval_pass = False
        self._in_backward = False
        self._active = False          # inside engine(...): unit forwards may gather
        self._pending_release: List[_Group] = []
        self._gathered: Dict[int, _Group] = {}  # groups whose memory is gathered now
        self._holdings: List[_autograd.Holding] = []
        self._losses: List[float] = []
        self.last_report: Optional[dict] = None
        self._hook_seconds = 0.0      # time inside the front end's hooks (gathers and releases included)
        self._hook_calls = 0

    # ---- set-up -------------------------------------------------------------------------
    def _check_parameters(self, plans: List[_groups.GroupPlan]) -> None:
        for plan in plans:
            for piece in plan.pieces:
                name, p = piece.name, piece.param
                if not p.is_floating_point():
                    raise StrataError(f"parameter {name} is {p.dtype}: the engine holds floating-point parameters only")
                if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise StrataError(f"parameter {name} is {p.dtype}: the engine holds fp32, bf16 and fp16 parameters")
                if p.device.type not in ("cpu", "meta") and p.device != self.device:
                    raise StrataError(f"parameter {name} is on {p.device}, but the engine computes on {self.device}: move the "
                                      "model there, build it under strata.init_empty(), or set \"strata\": {\"device\": ...}")

    def _shared_trainable_groups(self, plans: List[_groups.GroupPlan]) -> int:
        """Trainable groups bound by more than one unit: each keeps its gradient buffer from
        one unit's backward to the other's."""
        users: Dict[int, int] = {}
        for unit in self._units:
            for gid in {gid for b in unit.bindings for gid, _, _ in self._where[id(b.param)]}:
                users[gid] = users.get(gid, 0) + 1
        return sum(1 for gid, n in users.items() if n > 1 and plans[gid].trainable)

    def _write_model_values(self) -> None:
        for g in self._groups:
            flat = torch.zeros(g.layout["numel"], dtype=torch.float32)
            for index, piece in enumerate(g.pieces):
                g.tensor(flat, index).copy_(piece.values(piece.param.detach()).float().reshape(piece.shape))
            self._session.write_group(g.id, dlpack.to_dlpack(flat))
        self._session.refresh()

    def _take_parameters(self) -> None:
        on_cpu = self.device.type == "cpu"
        for p in self._params:
            p.strata_shape = tuple(p.shape)
            # On the CPU device meta stays meta (init_empty); on a GPU every placeholder is on
            # it, so code that asks a model for its device (its first parameter's) gets the GPU.
            p.data = torch.empty(0, dtype=p.dtype, device=p.device if on_cpu else self.device)
        if not on_cpu:
            move_buffers(self.module, self.device)

    def _install_hooks(self) -> None:
        for unit in self._units:
            # Groups held gathered through the unit's forward; a parameter cut into pieces is
            # assembled at each bind, its pieces gathered one at a time (unit.piece_gids).
            entries = [e for b in unit.bindings for e in self._where[id(b.param)]]
            unit.gids = sorted({gid for gid, _, piece in entries if piece.whole})
            unit.piece_gids = sorted({gid for gid, _, piece in entries if not piece.whole})
            unit.bound = False
            unit.uses = []  # this micro-batch's forward uses with a GatherFn, newest last
            unit.pieced = _pieced.install(self, unit)  # a head or embedding that computes by pieces
            unit.module.register_forward_pre_hook(self._make_pre_hook(unit))
            unit.module.register_forward_hook(self._make_post_hook(unit))
            # A checkpointed block may be recomputed by calling its forward directly, without
            # its own hooks (transformers 5): its inner modules' hooks bind it then.
            inner = {id(b.module): b.module for b in unit.bindings if b.module is not unit.module}
            for module in inner.values():
                module.register_forward_pre_hook(self._make_inner_hook(unit))

    # ---- the API ------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self._check_open()
        if torch.is_grad_enabled():
            if self._phase == "backward":
                raise StrataError("forward after backward() without step(): call engine.step() after every backward")
            self._session.begin_micro_batch()
            self._phase = "forward"
            return self._run(args, kwargs)
        if self._session.in_micro_batch:
            return self._run(args, kwargs)
        self._session.begin_forward()
        self._eval_pass = True
        try:
            return self._run(args, kwargs)
        finally:
            self._eval_pass = False
            self._release_all()
            self._session.end_forward()

    def _join_caller_stream(self) -> None:
        """On a GPU: the engine's gathers and gradient hand-overs are ordered against the
        caller's current stream (events on the device, no host wait)."""
        if self.device.type == "cuda":
            self._session.use_caller_stream(torch.cuda.current_stream(self.device).cuda_stream)

    def _run(self, args, kwargs):
        self._join_caller_stream()
        self._active = True
        try:
            return self.module(*args, **kwargs)
        except BaseException:
            self._abandon_forward()
            raise
        finally:
            self._active = False

    def _abandon_forward(self) -> None:
        """After an exception inside the model's forward: units left bound are unbound (their
        saved-tensor hooks popped, innermost first) and every gathered group is released, so
        the engine can still be closed or the step retried."""
        for unit in reversed(self._units):
            if unit.bound:
                hooks, unit.hooks = getattr(unit, "hooks", None), None
                if hooks is not None:
                    hooks.__exit__(None, None, None)
                self._unbind(unit)
        for g in self._groups:
            g.open = 0
        self._release_all()

    def backward(self, loss: torch.Tensor) -> None:
        """Scales the loss (1 / (gradient_accumulation_steps x world size), and the fp16 loss
        scale) and runs backward; gradients land in the engine as they are produced."""
        self._check_open()
        if self._phase != "forward":
            raise StrataError("backward() without a training forward since the last step(): call engine(**batch) first")
        scale = self._session.loss_scale / (self._session.gradient_accumulation_steps * self._session.world_size)
        self._join_caller_stream()
        self._in_backward = True
        try:
            (loss * scale).backward()
        finally:
            self._in_backward = False
            self._finish_backward()
        self._losses.append(float(loss.detach()))
        self._phase = "backward"

    def step(self) -> None:
        """After every micro-batch; the update runs at the accumulation boundary."""
        self._check_open()
        if self._phase != "backward":
            raise StrataError("step() without backward(): each micro-batch is engine(**batch), engine.backward(loss), engine.step()")
        loss = sum(self._losses) / len(self._losses)
        report = self._session.end_micro_batch(loss)
        self._phase = "idle"
        if report is not None:
            self._losses = []
            self.last_report = report

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._session.in_micro_batch is False and not self._losses

    @property
    def global_steps(self) -> int:
        return self._session.steps_taken

    def get_lr(self) -> List[float]:
        return [self._session.learning_rate]

    def plan(self) -> dict:
        return self._session.plan()

    @property
    def placement(self) -> Optional[str]:
        """Under strata.placement "auto": the placement chosen, its predicted step and the
        runner-up, as logged; None when the config's own placement is used."""
        return self._session.placement_text or None

    def hook_stats(self) -> dict:
        """The front end's own cost: calls of its unit hooks and GatherFn backwards, and the
        seconds spent in them (engine gathers and releases included)."""
        return {"calls": self._hook_calls, "seconds": self._hook_seconds}

    @property
    def rank(self) -> int:
        return self._session.rank

    @property
    def world_size(self) -> int:
        return self._session.world_size

    def close(self) -> None:
        """Waits for the last update and frees the engine; the engine is unusable after.
        Inside a step (after an error, say) the step is abandoned."""
        if not self._session.closed:
            self._release_all()
            self._session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- state in and out ---------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: Optional[dict] = None) -> None:
        """Saves save_dir/step-<N>: the engine's state, the schedule's and client_state (rank
        0's). With more than one process every rank calls it with the same save_dir (a
        directory all of them reach): each writes its own shards, rank 0 commits the step
        once every rank's file is in, and every rank returns after that — or raises, when a
        rank failed, leaving no step-<N>."""
        self._check_between_steps("save_checkpoint()")
        if tag is not None:
            raise StrataError("save_checkpoint(tag=...) is not supported: checkpoints are named step-<N> by the engine")
        self._session.save_checkpoint(os.fspath(save_dir), json.dumps(client_state or {}))

    def load_checkpoint(self, load_dir: str):
        """Loads the newest complete checkpoint of load_dir (or load_dir itself when it is
        one step-<N> directory); returns (path, client_state) as DeepSpeed does. With more
        than one process every rank calls it: rank 0 picks the checkpoint and each rank loads
        its shards of it, whatever number of processes saved it."""
        self._check_between_steps("load_checkpoint()")
        client = json.loads(self._session.load_checkpoint(os.fspath(load_dir)))
        # A checkpoint holds trainable state only: frozen groups still need load_hf.
        self._needs_load = self._needs_load and any(not g.trainable for g in self._groups)
        return os.fspath(load_dir), client

    def _hf_names(self):
        """Each tensor's name in a Hugging Face checkpoint of the model: a PEFT model's base
        weights under their base model's names; adapters (not in such a checkpoint: "")."""
        return [(_checkpoint_name(piece.name), g.id, index, piece.element_offset(), list(piece.param.strata_shape))
                for g in self._groups for index, piece in enumerate(g.pieces)]

    def export_hf(self, out_dir: str, tokenizer_dir: Optional[str] = None, shard_bytes: int = 0,
                  dtype: Optional[torch.dtype] = None) -> None:
        """Writes a directory from_pretrained loads: config.json, (sharded) safetensors and
        the tokenizer files of tokenizer_dir. With more than one process every rank calls it
        with the same arguments: rank 0 writes out_dir with the groups gathered from every
        rank, one at a time, and every rank returns once it is complete (or raises)."""
        self._check_between_steps("export_hf()")
        config = getattr(self.module, "config", None)
        config_json = config.to_json_string() if hasattr(config, "to_json_string") else "{}"
        dtype = dtype or self._params[0].dtype
        names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
        self._session.export_hf(os.fspath(out_dir), config_json, self._hf_names(), os.fspath(tokenizer_dir or ""),
                                int(shard_bytes), names[dtype])

    def load_hf(self, model_dir: str) -> None:
        """Streams a Hugging Face directory's weights into the engine by parameter name."""
        self._check_between_steps("load_hf()")
        self._session.load_hf(os.fspath(model_dir), self._hf_names())
        self._needs_load = False

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The full fp32 weights by parameter name (one group at a time through host memory).
        With more than one process every rank calls it and gets the full weights, gathered
        from every rank's shards."""
        self._check_between_steps("state_dict()")
        out: Dict[str, torch.Tensor] = {}
        for g in self._groups:
            flat = torch.empty(g.layout["numel"], dtype=torch.float32)
            self._session.read_group(g.id, dlpack.to_dlpack(flat))
            for index, piece in enumerate(g.pieces):
                full = out.setdefault(piece.name, torch.empty(piece.param.strata_shape, dtype=torch.float32))
                piece.values(full).copy_(g.tensor(flat, index).reshape(piece.values(full).shape))
        return out

    def _check_open(self) -> None:
        if self._session.closed:
            raise StrataError("the engine was closed")
        if self._needs_load:
            raise StrataError("the model was built under strata.init_empty(): load its weights with engine.load_hf(dir) "
                              "or engine.load_checkpoint(dir) before training")

    def _check_between_steps(self, call: str) -> None:
        if self._session.closed:
            raise StrataError(f"{call} after close()")
        if self._phase != "idle" or self._losses:
            raise StrataError(f"{call} inside a step: call it after step() at an accumulation boundary")

    # ---- unit forwards ------------------------------------------------------------------
    def _timed(self, fn):
        def timed(*args):
            began = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self._hook_seconds += time.perf_counter() - began
                self._hook_calls += 1
        return timed

    def _make_pre_hook(self, unit):
        @self._timed
        def pre_hook(module, args):
            if not (self._active or self._in_backward):
                raise StrataError(f"{unit.name} ran outside the engine: call engine(...) rather than the model, "
                                  "so its parameters are gathered")
            self._flush_releases()
            for gid in unit.gids:
                g = self._gather(self._groups[gid])
                g.open += 1
            if not self._in_backward and not self._eval_pass:
                for gid in unit.gids + unit.piece_gids:
                    self._groups[gid].expected += self._groups[gid].trainable
            unit.handle = self._bind(unit)
            unit.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            unit.hooks.__enter__()
        return pre_hook

    def _make_post_hook(self, unit):
        @self._timed
        def post_hook(module, args, output):
            hooks, unit.hooks = unit.hooks, None
            hooks.__exit__(None, None, None)
            self._unbind(unit)
            handle, unit.handle = unit.handle, None
            if self._in_backward and handle is not None:
                self._hold(handle, _autograd.Holding(unit, unit.gids, bound=False))
            for gid in unit.gids:
                g = self._groups[gid]
                g.open -= 1
                if self._in_backward:
                    self._release_when_unused(g)
                elif g.open == 0:
                    self._release(g)
            return None
        return post_hook

    def _make_inner_hook(self, unit):
        def inner_hook(module, args):
            if unit.bound:
                return None
            if not self._in_backward:
                raise StrataError(f"a module of {unit.name} ran without {unit.name}'s forward: call the unit (its __call__), "
                                  "not its forward(), so its parameters are gathered")
            self._bind_for_recompute(unit)
            return None
        return inner_hook

    def _bind_for_recompute(self, unit) -> None:
        """A unit recomputed in backward without its hooks: gathered and bound until its
        recompute's GatherFn runs (reentrant checkpointing: the recompute's graph is the one
        backward follows) or its forward's (non-reentrant: backward follows the forward's
        graph, with the recomputed tensors)."""
        self._flush_releases()
        for gid in unit.gids:
            self._gather(self._groups[gid])
        handle = self._bind(unit)
        holding = _autograd.Holding(unit, unit.gids, bound=True)
        if handle is not None:
            self._hold(handle, holding)
        if unit.uses:
            self._hold(unit.uses.pop(), holding)

    def _hold(self, handle: _autograd.UseHandle, holding: _autograd.Holding) -> None:
        if holding not in handle.holdings:
            handle.holdings.append(holding)
        if all(h is not holding for h in self._holdings):
            self._holdings.append(holding)
            for gid in holding.groups:
                self._groups[gid].holds += 1

    def _end_holding(self, holding: _autograd.Holding) -> None:
        if holding.done:
            return
        holding.done = True
        self._holdings.remove(holding)
        if holding.bound:
            self._unbind(holding.unit)
        for gid in holding.groups:
            g = self._groups[gid]
            g.holds -= 1
            self._release_when_unused(g)

    def _bind(self, unit) -> Optional[_autograd.UseHandle]:
        """Points the unit's parameters into its gathered groups (a parameter cut into pieces
        joined by rows); trainable ones, with gradients enabled, through one GatherFn, whose
        handle is returned."""
        trainable_views, slots, bound = [], [], {}
        pieced = unit.pieced.param if unit.pieced is not None else None
        for b in unit.bindings:
            if id(b.param) in bound or b.param is pieced:  # a weight in pieces stays out (_pieced.py)
                continue
            entries = self._where[id(b.param)]
            if len(entries) == 1:
                gid, index, _ = entries[0]
                view = self._groups[gid].tensor(self._groups[gid].flat, index)
            else:
                view = self._assemble(b.param, entries)
            if self._groups[entries[0][0]].trainable and torch.is_grad_enabled():
                bound[id(b.param)] = len(trainable_views)
                trainable_views.append(view)
                slots.append(entries)
            else:
                bound[id(b.param)] = view if view.dtype == b.param.dtype else view.to(b.param.dtype)
        handle = None
        outputs: tuple = ()
        if trainable_views:
            handle = _autograd.UseHandle(self, trainable_views, slots)
            outputs = _autograd.GatherFn.apply(_autograd.make_anchor(self.device), handle)
            if not self._in_backward:
                unit.uses.append(handle)
        for b in unit.bindings:
            if b.param is pieced:
                continue
            value = bound[id(b.param)]
            if isinstance(value, int):
                value = outputs[value]
                if value.dtype != b.param.dtype:
                    value = value.to(b.param.dtype)
            b.module._parameters[b.attr] = value
        unit.bound = True
        return handle

    def _assemble(self, param: nn.Parameter, entries) -> torch.Tensor:
        """A parameter cut into pieces, joined into one tensor: each piece gathered, copied
        and released in turn, so a unit never holds more than one piece's slot."""
        full = None
        for gid, index, piece in entries:
            g = self._groups[gid]
            held = g.flat is not None
            self._gather(g)
            view = g.tensor(g.flat, index)
            if full is None:
                full = torch.empty(piece.full_shape, dtype=view.dtype, device=view.device)
            piece.values(full).copy_(view)
            if not held:
                self._release(g)
        return full

    def _unbind(self, unit) -> None:
        for b in unit.bindings:
            b.module._parameters[b.attr] = b.param
        unit.bound = False

    # ---- gathers and releases -----------------------------------------------------------
    def _gather(self, g: _Group) -> _Group:
        if g.flat is None:
            capsule = self._session.gather(g.id)
            g.flat = dlpack.from_dlpack(capsule)
            self._gathered[g.id] = g
        if g in self._pending_release:
            self._pending_release.remove(g)
        return g

    def _release(self, g: _Group) -> None:
        if g.flat is not None:
            g.flat = None
            del self._gathered[g.id]
            self._session.release(g.id)

    def _release_when_unused(self, g: _Group) -> None:
        if g.flat is not None and g.open == 0 and g.refs == 0 and g.holds == 0 and g not in self._pending_release:
            self._pending_release.append(g)

    def _flush_releases(self) -> None:
        pending, self._pending_release = self._pending_release, []
        for g in pending:
            if g.open == 0 and g.refs == 0 and g.holds == 0:
                self._release(g)

    def _release_all(self) -> None:
        self._pending_release = []
        for g in self._groups:
            self._release(g)

    # ---- saved tensors ------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        for g in self._gathered.values():
            if g.holds_memory_of(t):
                g.refs += 1
                offset = (t.data_ptr() - g.flat.data_ptr()) // t.element_size()
                return _autograd.SavedRef(g.id, offset, t.size(), t.stride())
        return t

    def _unpack(self, saved):
        if not isinstance(saved, _autograd.SavedRef):
            return saved
        self._check_in_backward()
        g = self._groups[saved.group]
        if g.flat is None:
            self._flush_releases()
            self._gather(g)
        g.refs -= 1
        view = g.flat.as_strided(saved.size, saved.stride, saved.offset)
        self._release_when_unused(g)
        return view

    # ---- gradients ----------------------------------------------------------------------
    def _use_backward(self, handle: _autograd.UseHandle, grads) -> None:
        """GatherFn's backward: one unit use's parameter gradients are complete."""
        began = time.perf_counter()
        try:
            self._add_gradients(handle, grads)
        finally:
            self._hook_seconds += time.perf_counter() - began
            self._hook_calls += 1

    def _add_gradients(self, handle: _autograd.UseHandle, grads) -> None:
        self._check_in_backward()
        self._flush_releases()
        # Group by group, each handed over before the next buffer is asked for: a unit may
        # hold more groups than the engine has gradient buffers.
        parts: Dict[int, list] = {}
        for entries, grad in zip(handle.slots, grads):
            for gid, index, piece in entries:
                part = grad if grad is None or len(entries) == 1 else grad[piece.row_begin:piece.row_end]
                parts.setdefault(gid, []).append((index, part))
        for gid, group_parts in parts.items():
            g = self._groups[gid]
            for index, part in group_parts:
                if part is not None:
                    self._add_gradient(g, index, part)
            self._use_done(g)
        for holding in handle.holdings:
            self._end_holding(holding)

    def _add_gradient(self, g: _Group, index: int, part: torch.Tensor) -> None:
        target = g.tensor(self._gradient_buffer(g), index)
        if index in g.written:
            _add_into(target, part)
        else:  # the buffer is handed out unwritten: the first gradient is a copy
            target.copy_(part)
            g.written.add(index)

    def _use_done(self, g: _Group) -> None:
        """One forward use of the group has all its gradients in the buffer."""
        if g.expected > 0:
            g.expected -= 1
            if g.expected == 0:
                self._grads_ready(g)

    def _deliver_gradient(self, g: _Group, index: int, part: torch.Tensor) -> None:
        """A use's whole gradient of one tensor of a group that holds only it (_pieced.py)."""
        self._add_gradient(g, index, part)
        self._use_done(g)

    def _deliver_rows(self, g: _Group, index: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """As _deliver_gradient for a gradient that is zero outside `rows` (an embedding's)."""
        target = g.tensor(self._gradient_buffer(g), index)
        if index not in g.written:  # the buffer is handed out unwritten
            target.zero_()
            g.written.add(index)
        target.index_add_(0, rows, values.to(target.dtype))
        self._use_done(g)

    def _check_in_backward(self) -> None:
        if not self._in_backward:
            raise StrataError("backward ran outside engine.backward(loss): call engine.backward(loss), not loss.backward()")

    def _gradient_buffer(self, g: _Group) -> torch.Tensor:
        """The group's buffer for this micro-batch, handed out unwritten (not zeroed): each
        tensor's first gradient is copied in, and _grads_ready zeroes the rest."""
        if g.grads is None:
            g.grads = dlpack.from_dlpack(self._session.gradient_buffer(g.id))
        return g.grads

    def _grads_ready(self, g: _Group) -> None:
        if not g.ready:
            grads = self._gradient_buffer(g)
            for index in range(len(g.layout["tensors"])):
                if index not in g.written:  # no gradient reached it (a group no gradient reached: every one)
                    g.tensor(grads, index).zero_()
            for begin, end in g.gaps:
                grads[begin:end].zero_()
            g.grads = None
            g.ready = True
            self._session.grads_ready(g.id)

    def _finish_backward(self) -> None:
        """After loss.backward(): every group released, every trainable group's gradients
        handed over (a group no gradient reached gets zeros), the counts reset."""
        for holding in list(self._holdings):
            self._end_holding(holding)
        self._release_all()
        for g in self._groups:
            if g.trainable:
                self._grads_ready(g)
        for g in self._groups:
            g.open = g.refs = g.holds = g.expected = 0
            g.ready = False
            g.grads = None
            g.written = set()
        for unit in self._units:
            unit.uses = []


_PEFT_PREFIX = "base_model.model."
_ADAPTER_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def _checkpoint_name(name: str) -> str:
    if not name.startswith(_PEFT_PREFIX):
        return name
    if any(marker in name for marker in _ADAPTER_MARKERS):
        return ""
    return name[len(_PEFT_PREFIX):].replace(".base_layer.", ".")
