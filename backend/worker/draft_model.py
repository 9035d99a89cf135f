"""A draft model (llama-server's `-md`, `--spec-type draft-simple`): a second, small model of the
same vocabulary in the same worker, its own context with a sequence per slot, whose greedy
tokens are the draft a slot's verify step checks (backend.worker.verify).

    DraftModel.load(path, target, ...)    a ValueError in one line where it cannot draft
    DraftModel.draft(slot, run, owner, prompt, context, last, k) -> tokens
    DraftModel.give_way(slot, owner, ids) -> (n, state)   beside the target's RAM entry
    DraftModel.restore(slot, owner, ids, state)          with it

- **Compatible vocabularies only** (llama.cpp's common_speculative_are_compatible): the same
  vocabulary type, the same BOS and EOS use and ids, sizes within 128 tokens, and the same text
  for every token from id 5 on. Otherwise the worker does not start, and says why in one line.
- **Its KV follows the slot's tokens, and its drafts the tokens alone.** At a job's first draft
  its sequence keeps what it holds of the prompt only at a batch edge of the prompt, exactly (the
  engine's rules: the prompt's cold-run batches), or takes more of it from another slot's
  sequence that holds it so (a copy of exact cells: what a cold prefill computes; a subagent
  beside its main session shares the system prompt and tools), and prefills the rest as a cold
  run does, one batch a step (the other slots' steps go on between; the slot's token waits for
  its first draft, so a hit drafts what its cold run drafted); from then on it evaluates the
  slot's accepted tokens and the waiting one, then drafts one token at a time (its argmax, as
  llama.cpp's top-k 10 sampler takes its first; `p_min`: none less likely than that among
  those ten); at the next draft it keeps what it holds of the slot's tokens and evaluates the
  rest. So a job's drafts are a function of its prompt and answer, and a cache hit of the
  target drafts what its cold run drafted.
- **Its state goes with the target's into the RAM tier and to disk** (as llama-server's prompt
  cache keeps both): when a slot's live state gives way (`give_way`), the sequence's exact part
  of the same tokens, cut back to its own batch edge, joins the RAM entry, counted in its size
  and budget; a restore of that entry loads it back (`restore`). A job's last snapshot for a
  state file takes, as the file's *twin* (backend.store), what one of the owner's sequences
  holds exactly of its tokens at a batch edge (`twin`: the job's prompt once its first draft
  filled it, while the snapshot waits for its file; else what the sequence held when the
  snapshot was taken, most often the session's previous prompt), where reading it back costs
  less than prefilling it (the draft model's prefills as measured, the disk's restores); a
  restore of the file loads it with the model's state. A window's snapshot holds the state at
  its sequence's end only (plain attention's is cut to any edge), so there the twin is taken
  as the prompt's prefill reaches the snapshot's tokens (`want`), and kept until it goes with
  the file or the job ends. A hit from the shared tier,
  which holds the target's states only, prefills the draft model's prompt again where no
  slot's sequence, RAM entry or twin holds it.
- **Owners.** A sequence serves only jobs of the (tenant, salt) that filled it, as the target's
  live KV does: none is kept or copied across tenants or cache salts.
- **Memory.** A recurrent or hybrid draft model cannot be cut back after a draft: refused.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import llama_cpp
import numpy as np

from backend.engine import Engine
from backend.worker.messages import Live, live_prefix
from policies.costs import Costs, Fit, pays
from policies.prefix import Edges

Owner = tuple[str, bytes]  # (tenant, cache salt) of the job whose tokens a sequence holds

VOCAB_MAX_DIFFERENCE = 128  # SPEC_VOCAB_MAX_SIZE_DIFFERENCE
VOCAB_CHECK_FROM = 5  # SPEC_VOCAB_CHECK_START_TOKEN_ID
TOP_K = 10  # llama.cpp's draft sampler


def incompatible(target: Engine, draft: Engine) -> str:
    """Why the draft model's vocabulary cannot draft for the target's ("" where it can)."""
    vt, vd = target.vocab, draft.vocab
    if llama_cpp.llama_vocab_type(vt) != llama_cpp.llama_vocab_type(vd):
        return "its vocabulary is of another type"
    for name in ("bos", "eos"):
        add = getattr(llama_cpp, f"llama_vocab_get_add_{name}")
        tok = getattr(llama_cpp, f"llama_vocab_{name}")
        if add(vt) != add(vd) or (add(vt) and tok(vt) != tok(vd)):
            return f"its {name.upper()} token differs"
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_MAX_DIFFERENCE:
        return f"its vocabulary has {draft.n_vocab} tokens, the model's {target.n_vocab}"
    for i in range(VOCAB_CHECK_FROM, min(target.n_vocab, draft.n_vocab)):
        if llama_cpp.llama_vocab_get_text(vt, i) != llama_cpp.llama_vocab_get_text(vd, i):
            return f"token {i} differs"
    return ""


@dataclass(slots=True)
class DraftModel:
    engine: Engine
    n_vocab: int  # the target's: no draft token past it
    path: str
    begun: dict[int, str] = field(default_factory=dict)  # slot -> the run its KV follows
    owners: dict[int, Owner] = field(default_factory=dict)  # slot -> whose tokens it holds
    # prompt tokens at a job's first draft: kept in the slot's sequence (restored with the
    # target's RAM entry, or left by its previous job), copied from another slot's, prefilled
    prompt: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("kept", "restored", "copied", "prefilled"), 0))
    restored: dict[int, int] = field(default_factory=dict)  # slot -> tokens a load put there
    # slot -> (the prompt, its batch edges) while its sequence is prefilled, a batch a step
    filling: dict[int, tuple[list[int], Edges]] = field(default_factory=dict)
    prefills: Fit = field(default_factory=Fit)  # its prefill batches' seconds (policies.costs)
    # a window's twins (`want`): slot -> (the run, n, the disk's restores) of a twin to take
    # when its sequence holds exactly n tokens, and slot -> (the run, the owner, its ids, the
    # state) once taken, until `twin` hands it on
    wanted: dict[int, tuple[str, int, Fit]] = field(default_factory=dict)
    kept: dict[int, tuple[str, Owner, np.ndarray, memoryview]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str, target: Engine, n_gpu_layers: int, threads: int | None,
             override_kv: str = "") -> DraftModel:
        """The draft model, a context of the target's slots and size; a ValueError (one line)
        where it cannot draft for the target. `override_kv`: the target's metadata overrides,
        which llama-server gives its draft model too."""
        eng = Engine(path, target.n_ctx * len(target.seqs), threads, n_gpu_layers,
                     n_batch=target.n_batch, flash_attn=target.flash_attn,
                     n_seq=len(target.seqs), outputs=len(target.seqs),  # a row each
                     placement={"repack": "on" if target.placement.get("repack") else "off",
                                "override_kv": override_kv},
                     rope=target.rope)  # as llama-server gives its draft model
        why = incompatible(target, eng)
        if not why and eng.memory.kind == "recurrent":
            why = "a recurrent state cannot be cut back after a draft"
        if not why and eng.memory.kind == "window" and not eng.memory.full:
            why = "a real sliding window may not be cut back after a draft"
        if why:
            eng.close()
            raise ValueError(f"the draft model {path} cannot draft for this model: {why}")
        return cls(eng, target.n_vocab, path)

    def close(self) -> None:
        self.engine.close()

    def _held(self, slot: int, ids: np.ndarray, edges: Edges) -> int:
        """Tokens of the prompt `ids` the slot's sequence holds exactly, at a batch edge."""
        eng, q = self.engine, self.engine.seqs[slot]
        return live_prefix(Live(q.ids, q.n_live, q.exact_n, eng.floor(slot), 0), ids, edges)

    def _begin(self, slot: int, owner: Owner, prompt: Sequence[int]) -> None:
        """The slot's sequence starts the prompt as a cold prefill computes it: what it holds
        of it at a batch edge kept (its previous job's, or restored with the target's RAM
        entry), or more of it copied from another slot's sequence of the same owner (a
        subagent's draft beside its main session's: the same system prompt and tools); the rest
        is prefilled by `_fill`, a batch a step."""
        eng = self.engine
        ids = list(prompt)
        edges, a = eng.batching.edges(ids), np.asarray(ids, dtype=np.intc)
        self.filling[slot] = (ids, edges)
        held = [self._held(s, a, edges) if self.owners.get(s) == owner else 0
                for s in range(len(eng.seqs))]  # per slot: the prompt it holds so
        src = max((s for s in range(len(held)) if s != slot), key=held.__getitem__,
                  default=slot)
        own, n = held[slot], held[src]
        if n > own and eng.copy(src, slot, n) == n:
            self.prompt["copied"] += n
        else:
            n = eng.truncate(slot, own)
            restored = min(n, self.restored.get(slot, 0))
            self.prompt["restored"] += restored
            self.prompt["kept"] += n - restored
        self.restored.pop(slot, None)
        self.owners[slot] = owner
        self.prompt["prefilled"] += len(ids) - n

    def _fill(self, slot: int) -> bool:
        """One batch more of the prompt `_begin` started, in the cold run's batches; whether
        the sequence holds all of it now. A batch a step: the other slots' steps go on between
        (a 2,200-token prompt in one step held every other slot 5.6 s), and the slot's token
        waits for its first draft meanwhile, so a hit drafts and verifies what its cold run
        did."""
        ids, edges = self.filling[slot]
        q = self.engine.seqs[slot]
        if q.n_live < len(ids):
            start, t = q.n_live, time.perf_counter()
            self.engine.prefill_batch(slot, ids, edges.next(q.n_live))
            self.prefills = Costs(self.prefills).add_prefill(
                start, q.n_live, time.perf_counter() - t).prefill
        if q.n_live < len(ids):
            return False
        del self.filling[slot]
        return True

    def want(self, slot: int, run: str, n: int, disk: Fit) -> None:
        """The job `run` wants a twin of its first n prompt tokens (its last snapshot's) in a
        window's memory, where a snapshot holds the state at the sequence's end only and the
        sequence goes on past n: taken as its prefill reaches n (`_keep`), where it pays."""
        if self.engine.memory.kind == "window":
            self.wanted[slot] = (run, n, disk)

    def _keep(self, slot: int, run: str, owner: Owner) -> None:
        """The twin `want` asked for, taken if the sequence holds exactly its n tokens now (a
        batch edge of the prompt's cold run), where reading it back pays (`pays`)."""
        want, eng = self.wanted.get(slot), self.engine
        q = eng.seqs[slot]
        if want is None or want[0] != run or q.n_live < want[1]:
            return
        del self.wanted[slot]
        n = want[1]
        if q.n_live == n == q.exact_n and pays(Costs(self.prefills, want[2]), 0, n,
                                               eng.state_bytes(slot), "disk"):
            self.kept[slot] = (run, owner, q.ids[:n].copy(), eng.snapshot(slot))

    def give_way(self, slot: int, owner: Owner, ids: np.ndarray) -> tuple[int, memoryview] | None:
        """(n, the state) of the longest prefix of `ids` (the tokens of the target's state
        that gives way) the slot's sequence holds exactly at one of its batch edges, cut back
        to it; None where it holds none of them for this owner."""
        eng = self.engine
        if self.owners.get(slot) != owner:
            return None
        n = self._held(slot, ids, eng.batching.edges(ids.tolist()))
        if n == 0 or eng.truncate(slot, n) != n:
            return None
        self.begun.pop(slot, None)  # its answer is cut: a next draft begins again
        self.filling.pop(slot, None)
        return n, eng.snapshot(slot)

    def twin(self, owner: Owner, ids: np.ndarray, disk: Fit, above: int = 0
             ) -> tuple[int, memoryview] | None:
        """(n, the state) of the longest prefix of `ids` (a snapshot's tokens, on their way to
        a state file) that one of the owner's sequences holds exactly at one of its batch
        edges, copied (the sequence untouched), to go with the file; None where none holds
        more than `above` tokens of it, or where reading it back (at the disk's measured
        restores, `disk`) would cost more than prefilling it (the draft model's measured
        prefills)."""
        eng = self.engine
        edges = eng.batching.edges(ids.tolist())
        held = {s: self._held(s, ids, edges) for s, o in self.owners.items() if o == owner}
        if eng.memory.kind != "plain":  # a snapshot at p of a sequence that holds p alone
            held = {s: n for s, n in held.items() if n == eng.seqs[s].n_live}
        src = max(held, key=held.__getitem__, default=None)
        n = held[src] if src is not None else 0
        kept = self._kept(owner, ids, edges)
        if kept is not None and kept[0] > max(n, above):  # taken as the prefill reached it
            return kept
        if src is None or n <= above:
            return None
        nbytes = eng.state_bytes(src) * n // max(eng.seqs[src].n_live, 1)  # about
        if not pays(Costs(self.prefills, disk), 0, n, nbytes, "disk"):
            return None
        state = eng.snapshot_first(src, n)
        return None if state is None else (n, state)

    def _kept(self, owner: Owner, ids: np.ndarray, edges: Edges
              ) -> tuple[int, memoryview] | None:
        """The longest twin `_keep` took of the owner's that holds a prefix of `ids` ending at
        one of their batch edges (each handed on once)."""
        best = None
        for slot, (_, o, held, state) in self.kept.items():
            n = len(held)
            if o == owner and n <= len(ids) and edges.floor(n) == n \
                    and np.array_equal(held, ids[:n]) and (best is None or n > best[1]):
                best = (slot, n, state)
        if best is None:
            return None
        del self.kept[best[0]]
        return best[1], best[2]

    def drop_kept(self, slot: int, run: str) -> None:
        """The job's twin is no longer wanted (its file is written, or the job ended)."""
        for d in (self.wanted, self.kept):
            if slot in d and d[slot][0] == run:
                del d[slot]

    def restore(self, slot: int, owner: Owner, ids: Sequence[int], state: memoryview,
                shared: bool = False) -> None:
        """A sequence state `give_way` or `twin` made, for exactly `ids`, loaded into the slot's
        sequence (the target restored its RAM entry or file there); a ValueError where
        llama.cpp refuses it (the sequence is then empty). `shared`: another thread reads the
        state's buffer too (a queued snapshot's twin, being written): its form is made in a
        copy, not in place."""
        self.begun.pop(slot, None)
        self.filling.pop(slot, None)
        self.owners.pop(slot, None)
        if shared:
            self.engine.restore(slot, ids, state)
        else:
            self.engine.restore_held(slot, ids, state)
        self.owners[slot] = owner
        self.restored[slot] = len(ids)

    def holds_prompt(self, slot: int, run: str) -> bool:
        """Whether the slot's sequence holds the prompt of the job `run` (its first draft
        began it, and its batches are all done)."""
        return self.begun.get(slot) == run and slot not in self.filling

    def draft(self, slot: int, run: str, owner: Owner, prompt: Sequence[int],
              context: Sequence[int], last: int, k: int, p_min: float) -> list[int] | None:
        """Up to k greedy tokens after `context` (the slot's evaluated tokens: the prompt and
        the answer so far) and `last` (its sampled token, waiting for the step); None while
        the sequence's prompt is being prefilled (a batch of it done: the token waits)."""
        eng = self.engine
        if self.begun.get(slot) != run:
            self._begin(slot, owner, prompt)
            self.begun[slot] = run
            self._keep(slot, run, owner)
        if slot in self.filling:
            done = self._fill(slot)
            self._keep(slot, run, owner)
            if not done:
                return None
        q = eng.seqs[slot]
        held, now = q.ids[: q.n_live], np.asarray(context, dtype=np.intc)
        n = min(len(held), len(now))
        differ = np.flatnonzero(held[:n] != now[:n])
        keep = eng.truncate(slot, int(differ[0]) if len(differ) else n)
        if keep < len(prompt):  # never expected (plain attention cuts back anywhere)
            self._begin(slot, owner, prompt)
            self._fill(slot)
            return None
        pending = [*now[keep:].tolist(), last]
        while len(pending) > eng.n_batch:  # the answer's tokens it has not seen, in batches
            eng.evaluate([(slot, pending[: eng.n_batch])])
            pending = pending[eng.n_batch:]
        out: list[int] = []
        while len(out) < k and q.n_live + len(pending) < eng.n_ctx:
            eng.evaluate([(slot, pending)])
            logits = eng.last_logits(slot)
            token = int(np.argmax(logits))
            if p_min > 0:
                top = np.sort(logits)[-TOP_K:].astype(np.float64)
                if 1.0 / np.exp(top - top[-1]).sum() < p_min:
                    break
            if token >= self.n_vocab or token in eng.eog:
                break
            out.append(token)
            pending = [token]
        return out

    def measure(self, target: Engine) -> float:
        """Seconds of one of its steps over one of the target's, on slot 0 (left empty)."""
        from backend.selfcheck import random_ids

        def step(eng: Engine) -> float:
            ids = random_ids(eng, 40, 3)
            eng.truncate(0, 0)
            eng.prefill(0, ids[:32])
            least = float("inf")
            for i in range(4):
                t = time.perf_counter()
                eng.evaluate([(0, [ids[32 + i]])])
                least = min(least, time.perf_counter() - t) if i else least
            eng.truncate(0, 0)
            return least

        return step(self.engine) / step(target)
