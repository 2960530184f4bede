"""The contract every attention method of the core follows (full, exact Top-K, ReTopK, baselines).

A method is a small object built from its own config. Per model layer the caller creates one state
with ``init_state`` (a pool of per-sequence slots that grows on demand), gives each sequence a slot,
tells the method about each prompt with ``prefill`` (after the prompt's keys and values are in the
KV cache) and then calls ``decode`` once per generated token for a whole batch of sequences. The
current token's key and value are already in the cache when ``decode`` runs, so ``kv.lengths[b]``
counts it. GQA: query head h reads KV head h // (H // H_kv).
"""

from __future__ import annotations

import torch

from retopk_core.kv import PagedKV
from retopk_core.methods.step_output import (  # noqa: F401 (re-exported: the methods' public contract)
    FULL_READ_PATHS,
    PATH_NAMES,
    Path,
    StepOutput,
    constant,
    group_reads,
    uniform_output,
)
from retopk_core.params import MethodConfig, ParamError


class SlotPool:
    """Per-sequence state tensors that share a leading slot dimension, grown by doubling.

    Subclasses list their tensors in ``_fields``; ``alloc`` hands out a free slot, ``free`` returns
    it (its contents are reset by ``reset_slot`` on the next ``alloc``).
    """

    _fields: tuple[str, ...] = ()
    # Bumped whenever one of the pool's tensors is replaced (grown, shrunk, set): whoever keeps references to
    # them (server/retopk_server/runtime/whole_step.py's prepared layers) knows by it that they are stale.
    generation = 0

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, torch.Tensor):
            object.__setattr__(self, "generation", self.generation + 1)
        object.__setattr__(self, name, value)

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = max(1, capacity)
        self._free = list(range(self.capacity - 1, -1, -1))

    def _own_mode(self) -> torch.inference_mode:
        """The mode to update the pool's tensors in: inference mode when any of them is an inference tensor (a
        pool made, or a field grown, inside inference mode: Loki's ``proj`` grows in a decode step), which only
        inference mode may update in place; else normal mode, so that a normal pool stays normal."""
        return torch.inference_mode(any(getattr(self, name).is_inference() for name in self._fields))

    def _grow(self) -> None:
        self.commit_grow(self.capacity * 2, self.prepare_grow(self.capacity * 2))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def prepare_grow(self, capacity: int) -> dict[str, torch.Tensor]:
        """New tensors of ``capacity`` (> the current) slots holding the current contents of the slots in use;
        nothing changes until ``commit_grow`` (so a caller can allocate every layer's before it commits any).
        The other slots are free and hold whatever the memory held: a free slot is never read, ``alloc`` resets
        it (``reset_slot``) or its caller writes every field (``write_slot``). So the grown tensors are neither
        zeroed nor, past the used slots, copied: memory no slot uses yet is not written (nor paged in)."""
        if capacity <= self.capacity:
            raise ValueError(f"capacity must exceed {self.capacity}, got {capacity}")
        grown, runs = {}, self._used_runs()
        with self._own_mode():
            for name in self._fields:
                t = getattr(self, name)
                grown[name] = t.new_empty((capacity, *t.shape[1:]))
                self._copy_used(name, grown[name], runs)
        return grown

    def _copy_used(self, name: str, new: torch.Tensor, runs: list[tuple[int, int]]) -> None:
        """``new[a:e] = name[a:e]`` for each run [a, e) of slots in use (``prepare_grow``'s copy; a pool whose slots
        leave part of a field unread copies less)."""
        t = getattr(self, name)
        for a, e in runs:
            new[a:e] = t[a:e]

    def _used_runs(self) -> list[tuple[int, int]]:
        """The slots in use as runs [a, e) of consecutive ids, ascending."""
        free, runs = set(self._free), []
        for s in range(self.capacity):
            if s in free:
                continue
            if runs and runs[-1][1] == s:
                runs[-1] = (runs[-1][0], s + 1)
            else:
                runs.append((s, s + 1))
        return runs

    def commit_grow(self, capacity: int, grown: dict[str, torch.Tensor]) -> None:
        """Adopt ``prepare_grow(capacity)``'s tensors; the new slots are free."""
        old = self.capacity
        for name, t in grown.items():
            setattr(self, name, t)
        self.capacity = capacity
        self._free = list(range(self.capacity - 1, old - 1, -1)) + self._free

    def highest_used(self) -> int:
        """The highest slot in use (-1: none is)."""
        free = set(self._free)
        return next((s for s in range(self.capacity - 1, -1, -1) if s not in free), -1)

    def shrink(self, capacity: int) -> None:
        """Keep only slots ``0 .. capacity - 1`` (every slot above them free; at least one stays): the slots in use
        are copied into tensors of that size (as ``prepare_grow`` copies them), so the memory of the others goes
        back. Slots in use keep their ids."""
        if not 1 <= capacity <= self.capacity or self.highest_used() >= capacity:
            raise ValueError(f"cannot shrink to {capacity} slots: {self.capacity} slots, the highest in use is "
                             f"{self.highest_used()}")
        runs = self._used_runs()  # all below capacity
        with self._own_mode():
            kept = {}
            for name in self._fields:
                t = getattr(self, name)
                kept[name] = t.new_empty((capacity, *t.shape[1:]))
                self._copy_used(name, kept[name], runs)
            for name, t in kept.items():  # after every copy: _copy_used may read other fields (ReTopK: fill)
                setattr(self, name, t)
        self.capacity = capacity
        self._free = [s for s in self._free if s < capacity]

    def alloc(self, fresh: bool = True) -> int:
        """A free slot, reset to a new sequence's state; ``fresh=False`` leaves whatever it held, for a caller
        that writes every field next (``write_slot``: an imported session), to whom the reset is wasted work."""
        with self._own_mode():
            if not self._free:
                self._grow()
            slot = self._free.pop()
            if fresh:
                self.reset_slot(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.capacity:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    def reset_slot(self, slot: int) -> None:
        for name in self._fields:
            getattr(self, name)[slot].zero_()

    def clear_slot(self, slot: int) -> None:
        """``reset_slot`` in the tensors' own mode (a session rewound to its start keeps its slot)."""
        with self._own_mode():
            self.reset_slot(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        """Make slot ``dst`` hold what slot ``src`` holds (a sequence forked into several, the server's n > 1)."""
        with self._own_mode():
            for name in self._fields:
                t = getattr(self, name)
                t[dst] = t[src]

    @property
    def fields(self) -> tuple[str, ...]:
        """Names of the per-slot state tensors; each has the slot dimension first."""
        return self._fields

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """``fields`` without a pool (an imported state checked before any is allocated)."""
        return cls._fields

    # Fields with a dimension the pool grows as sequences grow (Quest's pages, Loki's projected tokens): field ->
    # that dimension's index in the per-slot shape. A slot uses its first ``used_extent(slot)`` entries of it.
    _growing: dict[str, int] = {}

    def used_extent(self, slot: int) -> int:
        """How much of the growing dimension slot ``slot`` uses (pools with ``_growing`` fields say)."""
        raise NotImplementedError

    def ensure_extent(self, n: int) -> None:
        """Grow the growing dimension to at least ``n`` for every slot (pools with ``_growing`` fields say)."""
        raise NotImplementedError

    def read_slot(self, slot: int) -> dict[str, torch.Tensor]:
        """Copies of slot ``slot``'s tensors by field name: field f gives ``f[slot]``, of shape f.shape[1:], a
        growing field only its used extent (a session's state exported to move it to another server)."""
        out = {}
        for name in self._fields:
            t = getattr(self, name)[slot]
            if name in self._growing:
                t = t.narrow(self._growing[name], 0, self.used_extent(slot))
            out[name] = t.clone()
        return out

    def check_slot(self, tensors: dict[str, torch.Tensor]) -> None:
        """ValueError naming the first field of ``tensors`` (``read_slot``'s form) that is missing or whose
        shape or dtype differs from this pool's per-slot one (a growing dimension: any size, the same in every
        growing field; an int64 field may come as int32, which ``write_slot``'s copy widens exactly)."""
        if set(tensors) != set(self._fields):
            raise ValueError(f"state fields {sorted(tensors)} differ from this method's {sorted(self._fields)}")
        extents = {tensors[name].shape[dim] for name, dim in self._growing.items() if tensors[name].dim() > dim}
        if len(extents) > 1:
            raise ValueError(f"state fields {sorted(self._growing)} must agree on their grown size, got {extents}")
        for name in self._fields:
            t, want = tensors[name], getattr(self, name)
            shape = list(want.shape[1:])
            if name in self._growing and t.dim() == len(shape):
                shape[self._growing[name]] = t.shape[self._growing[name]]
            narrowed = t.dtype == torch.int32 and want.dtype == torch.long
            if tuple(t.shape) != tuple(shape) or (t.dtype != want.dtype and not narrowed):
                raise ValueError(f"state field {name!r}: {t.dtype} {tuple(t.shape)}, this method holds "
                                 f"{want.dtype} {tuple(shape)}")

    def write_slot(self, slot: int, tensors: dict[str, torch.Tensor], checked: bool = False) -> None:
        """Slot ``slot`` takes ``tensors`` (``read_slot``'s form), checked first (``check_slot``; ``checked``: the
        caller has just run it on these tensors, as a write of every layer that checks all before it writes any);
        a growing field's entries past what ``tensors`` brings are a fresh slot's."""
        if not checked:
            self.check_slot(tensors)
        with self._own_mode():
            if self._growing:
                name, dim = next(iter(self._growing.items()))
                self.ensure_extent(tensors[name].shape[dim])
                self.reset_slot(slot)
            for name in self._fields:
                dst = getattr(self, name)[slot]
                if name in self._growing:
                    dst = dst.narrow(self._growing[name], 0, tensors[name].shape[self._growing[name]])
                dst.copy_(tensors[name])

    def nbytes_per_slot(self) -> int:
        return sum(getattr(self, n)[0].numel() * getattr(self, n).element_size() for n in self._fields)


class NoState(SlotPool):
    """State of a method that keeps nothing between steps (full, exact Top-K, StreamingLLM, SparQ)."""


class AttentionMethod:
    """Base class: subclasses set ``name`` and implement ``decode`` (and ``prefill`` if stateful).

    A method is built from its config (an instance of ``config_class``, whose fields are its hyperparameters:
    ``retopk_core.params``) and a backend; ``make_method`` builds one by name from keyword hyperparameters.
    """

    name: str = ""
    # The dataclass of the method's hyperparameters (MethodConfig itself: none); None for a wrapper that
    # takes keywords of its own (fidelity_probe).
    config_class: type[MethodConfig] | None = MethodConfig
    config: MethodConfig | None = None
    backends: tuple[str, ...] = ("torch", "triton")
    backend: str = "torch"
    # The step object of the backend it runs on (methods/backend_steps.py: its ``name`` says which), chosen once
    # when built; None for a method without one (the baselines run their own torch code).
    steps = None
    # How many of the prompt's last queries ``prefill`` wants (ReTopK: C); 0 = none.
    prefill_queries: int = 0

    def __init__(self, config: MethodConfig | None = None, backend: str = "torch") -> None:
        if config is None:
            config = self.config_class()
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {config!r}")
        if backend not in self.backends:
            choices = ", ".join(repr(b) for b in self.backends[:-1]) + f" or {self.backends[-1]!r}"
            raise ParamError("backend", f"backend must be {choices}, got {backend!r}")
        self.config = config
        self.backend = backend

    def init_state(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu",
                   capacity: int = 1) -> SlotPool:
        return NoState(capacity)

    def prefill(self, state: SlotPool, slot: int, q: torch.Tensor | None, positions: torch.Tensor | None,
                kv: PagedKV, scale: float | None = None) -> None:
        """Observe a prompt (or a later turn's new tokens) of one sequence.

        q          (H, T, d) the last T <= prefill_queries queries after RoPE (None when 0 wanted)
        positions  (T,) their absolute positions; query at position p saw keys 0..p
        kv         the sequence alone (B = 1), its keys and values already appended
        scale      score scale (default 1/sqrt(d))
        """

    def decode(self, q: torch.Tensor, kv: PagedKV, state: SlotPool, slots: torch.Tensor,
               scale: float | None = None) -> StepOutput:
        """One decode step. q: (B, H, d) current queries after RoPE; slots: (B,) int64 state slots;
        scale: score scale (default 1/sqrt(d))."""
        raise NotImplementedError

    def check_state(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        """Bound an imported session's state (it comes from outside the process) before anything is written:
        ``tensors`` maps each field of ``init_state``'s pool to (num_layers, *its per-slot shape) for a session of
        ``length`` tokens. ValueError naming the field when a value a kernel indexes with, divides by or sizes a
        tensor with lies outside its bounds. A method that keeps state overrides this; the default refuses any
        state (NotImplementedError: it cannot be imported)."""
        if tensors:
            raise NotImplementedError(f"method {self.name!r}: its state cannot be imported")

    def describe(self) -> dict:
        """Name, every config field and the backend its steps run on, for logs, model info, session info and result
        tables: a "cpu" method whose fused kernel is not built runs the torch steps, and says so."""
        backend = self.backend if self.steps is None else self.steps.name
        if backend != self.backend:
            backend = f"{backend} ({self.backend} kernel not built)"
        return {"method": self.name, **(self.config.as_dict() if self.config is not None else {}), "backend": backend}
