"""Tests for retrieval.py (§3.2, A.3, eqs. 15-16): bank I/O, Embedder pooling and prompts, Retriever search.

Run: python -m pytest tests/test_retrieval.py -q
Everything is offline: tiny random-weight models and a WordLevel tokenizer are saved into tmp folders.
"""

import json
import re
import os
import sys

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import BertConfig, BertForMaskedLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import retrieval  # noqa: E402
from retrieval import Embedder, Retriever  # noqa: E402

VARIANTS = ["alder", "birch", "cedar"]
SCHEMAS = {  # task template, observation-lite trace template
    "cancel": ("cancel the order of {name} at {v}",
               '1. find_customer(name="{name}") -> C{n}\n2. cancel_order("C{n}") -> ok'),
    "refund": ("refund the last payment of {name} at {v}",
               '1. find_customer(name="{name}") -> C{n}\n2. list_payments("C{n}") -> P{n}\n3. refund("P{n}") -> ok'),
    "address": ("change the address of {name} at {v} to {city}",
                '1. find_customer(name="{name}") -> C{n}\n2. set_address("C{n}", city="{city}") -> ok'),
}
NAMES = ["ana", "ben", "cho", "dev", "eli", "fay"]
CITIES = ["oslo", "lima", "rome"]


def make_candidates():
    """18 rollouts: 3 schemas x 3 variants = 9 tasks, 2 rollouts each (same task text, different ids).

    Rollout n has reward 0.5 when n % 3 == 0, else 1.0, so a task has 0, 1 or 2 successes in the bank.
    """
    out, n = [], 400
    for s, (task_t, trace_t) in SCHEMAS.items():
        for vi, v in enumerate(VARIANTS):
            for _ in range(2):
                n += 1
                fill = dict(name=NAMES[(vi * 2 + len(s)) % 6], v=v, n=n, city=CITIES[vi])
                out.append(retrieval.make_entry(f"{s}-{v}", task_t.format(**fill), trace_t.format(**fill),
                                                0.5 if n % 3 == 0 else 1.0, {"variant": v, "schema": s}))
    return out


def build_tokenizer():
    """WordLevel tokenizer over every pre-token of the test corpus and the query prompt (no [UNK] in tests)."""
    pre = pre_tokenizers.Whitespace()  # splits r"\w+|[^\w\s]+"
    corpus = [retrieval.experience_text(e) for e in make_candidates()] + [f"Instruct: {retrieval.DEFAULT_INSTRUCTION}\nQuery:"]
    words = {w for text in corpus for w, _ in pre.pre_tokenize_str(text)}
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]"] + sorted(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A tiny random-weight Qwen3ForCausalLM + tokenizer saved to a folder (AutoModel loads its Qwen3Model)."""
    folder = tmp_path_factory.mktemp("tiny_qwen3")
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=0)
    Qwen3ForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_bert")
    tok = build_tokenizer()
    torch.manual_seed(1)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, pad_token_id=0)
    BertForMaskedLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def embedder(qwen_dir):
    return Embedder(qwen_dir, pooling="last", batch_size=4, device="cpu")


@pytest.fixture(scope="module")
def bank():
    return retrieval.build_bank(make_candidates(), threshold=0.9)


# --- bank ------------------------------------------------------------------------------------------------------

def test_build_bank_keeps_successes_only():
    cands = make_candidates()
    bank = retrieval.build_bank(cands, threshold=0.9)
    assert 0 < len(bank) < len(cands) and all(e["reward"] >= 0.9 for e in bank)
    assert len(retrieval.build_bank(cands, threshold=0.5)) == len(cands)
    with pytest.raises(ValueError, match="candidate 0: missing field 'trace'"):
        retrieval.build_bank([{"task_id": "a", "task": "t", "reward": 1.0}], 0.5)


@pytest.mark.parametrize("line, reason", [
    ('{"task_id": "x", "task": "t", "trace": "1. a -> b", ', "bad JSON"),
    ('{"task_id": "x", "task": "t", "reward": 1.0}', "missing field 'trace'"),
    ('{"task_id": 7, "task": "t", "trace": "1. a -> b", "reward": 1.0}', "field 'task_id' has wrong type int"),
    ('{"task_id": "x", "task": "t", "trace": "s", "reward": 1.0, "meta": [1]}', "field 'meta' has wrong type"),
    ('[1, 2]', "entry must be a JSON object, got list"),
])
def test_load_bank_bad_line_names_file_and_line(tmp_path, bank, line, reason):
    path = tmp_path / "bank.jsonl"
    retrieval.save_bank(str(path), bank[:2])
    with open(path, "a") as f:
        f.write("\n" + line + "\n")  # line 3 is blank (skipped), the bad line is line 4
    with pytest.raises(ValueError, match=re.escape(f"{path}:4: {reason}")):
        retrieval.load_bank(str(path))


def test_bank_round_trip(tmp_path, bank):
    path = str(tmp_path / "bank.jsonl")
    retrieval.save_bank(path, bank)
    assert retrieval.load_bank(path) == bank
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []


# --- embedder --------------------------------------------------------------------------------------------------

def test_vectors_are_unit_norm_float32(embedder, bank):
    d = embedder.embed_docs(bank)
    q = embedder.embed_queries([e["task"] for e in bank[:5]])
    assert d.dtype == np.float32 and d.shape == (len(bank), 32) and q.shape == (5, 32)
    np.testing.assert_allclose(np.linalg.norm(d, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, atol=1e-5)


class RecordingTokenizer:
    """Wraps a tokenizer and records every batch of strings it is called on."""

    def __init__(self, tok):
        self.tok, self.seen = tok, []

    def __call__(self, texts, **kw):
        self.seen.append(list(texts))
        return self.tok(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_query_and_doc_prompts_differ(qwen_dir, bank):
    emb = Embedder(qwen_dir, pooling="last", device="cpu")
    emb.tokenizer = RecordingTokenizer(emb.tokenizer)
    entry = bank[0]
    zq = emb.embed_queries([entry["task"]])
    zd = emb.embed_docs([entry])
    q_text, d_text = emb.tokenizer.seen[0][0], emb.tokenizer.seen[1][0]
    assert q_text == f"Instruct: {retrieval.DEFAULT_INSTRUCTION}\nQuery:{entry['task']}"
    assert d_text == entry["task"] + "\n" + entry["trace"]
    assert not np.allclose(zq, zd, atol=1e-3)


def test_pool_functions_left_and_right_padding():
    torch.manual_seed(0)
    h = torch.randn(3, 5, 4)  # (B, T, d)
    lengths = [5, 3, 1]
    right = torch.tensor([[1] * n + [0] * (5 - n) for n in lengths])  # (B, T)
    left = torch.tensor([[0] * (5 - n) + [1] * n for n in lengths])  # (B, T)
    for mask in (right, left):
        real = [h[b][mask[b].bool()] for b in range(3)]  # list of (n_b, d)
        torch.testing.assert_close(retrieval.last_pool(h, mask), torch.stack([r[-1] for r in real]))
        torch.testing.assert_close(retrieval.mean_pool(h, mask), torch.stack([r.mean(0) for r in real]))


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_pooling_matches_unpadded_hidden_states(qwen_dir, bank, pooling):
    """Right padding: each text's embedding equals pooling its own unpadded forward (batch invariance)."""
    emb = Embedder(qwen_dir, pooling=pooling, batch_size=8, device="cpu")
    texts = [retrieval.experience_text(e) for e in bank[:3]] + ["ana", "cancel the order"]
    got = emb.embed_texts(texts)  # (5, d)
    for text, row in zip(texts, got):
        ids = emb.tokenizer(text, return_tensors="pt")["input_ids"]  # (1, T)
        with torch.no_grad():
            hidden = emb.model(input_ids=ids).last_hidden_state[0]  # (T, d)
        v = hidden.mean(0) if pooling == "mean" else hidden[-1]  # (d,)
        np.testing.assert_allclose(row, (v / v.norm()).numpy(), atol=1e-5)


def test_last_pooling_with_left_padding_picks_last_real_token(qwen_dir, bank):
    emb = Embedder(qwen_dir, pooling="last", padding_side="left", batch_size=8, device="cpu")
    texts = ["ana", retrieval.experience_text(bank[0]), "refund the last payment"]
    got = emb.embed_texts(texts)
    enc = emb.tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    assert enc["attention_mask"][0, 0] == 0  # really left-padded
    with torch.no_grad():
        hidden = emb.model(**enc).last_hidden_state  # (B, T, d)
    want = hidden[:, -1]  # with left padding the last real token is the final column
    np.testing.assert_allclose(got, torch.nn.functional.normalize(want, dim=-1).numpy(), atol=1e-5)


def test_bert_mean_pooling_and_truncation(bert_dir, bank):
    emb = Embedder(bert_dir, pooling="mean", max_length=6, device="cpu")
    text = retrieval.experience_text(bank[0])
    first6 = " ".join(emb.tokenizer.convert_ids_to_tokens(emb.tokenizer(text)["input_ids"][:6]))
    a, b = emb.embed_texts([text, first6])
    np.testing.assert_allclose(a, b, atol=1e-5)
    enc = emb.tokenizer([first6], return_tensors="pt")
    with torch.no_grad():
        v = emb.model(**enc).last_hidden_state[0].mean(0)  # (d,)
    np.testing.assert_allclose(a, (v / v.norm()).numpy(), atol=1e-5)


def test_from_causal_lm_equals_automodel_folder(qwen_dir, embedder, bank):
    """AutoModel on a Qwen3ForCausalLM folder loads its base model with the same weights; from_model agrees."""
    lm = Qwen3ForCausalLM.from_pretrained(qwen_dir).train()
    emb = Embedder.from_model(lm, embedder.tokenizer, pooling="last")
    assert type(embedder.model).__name__ == "Qwen3Model" and emb.model is lm.model
    np.testing.assert_allclose(emb.embed_docs(bank[:4]), embedder.embed_docs(bank[:4]), atol=1e-5)
    assert lm.model.training  # the caller's train/eval mode is restored after embedding
    lm.eval()
    enc = embedder.tokenizer(["cancel the order of ana"], return_tensors="pt")
    with torch.no_grad():
        h = lm(**enc, output_hidden_states=True).hidden_states[-1][0, -1]  # (d,)
    np.testing.assert_allclose(emb.embed_texts(["cancel the order of ana"])[0], (h / h.norm()).numpy(), atol=1e-5)


# --- retriever -------------------------------------------------------------------------------------------------

def brute_force(zq, zd, bank, task_ids, n_ret, exclude_self):
    scores = zq @ zd.T  # (Q, N)
    out = []
    for tid, row in zip(task_ids, scores):
        order = [i for i in np.argsort(-row, kind="stable") if not (exclude_self and bank[i]["task_id"] == tid)]
        out.append(order[:n_ret])
    return out


@pytest.mark.parametrize("exclude_self", [True, False])
def test_retrieve_matches_numpy_brute_force(embedder, bank, exclude_self):
    r = Retriever(bank, embedder)
    queries = make_candidates()[::2]  # includes task_ids present in the bank and failed ones absent from it
    ids, tasks = [q["task_id"] for q in queries], [q["task"] for q in queries]
    got, scores = r.retrieve(ids, tasks, n_ret=4, exclude_self=exclude_self, return_scores=True)
    zq, zd = embedder.embed_queries(tasks), embedder.embed_docs(bank)
    want = brute_force(zq, zd, bank, ids, 4, exclude_self)
    index_of = {id(e): i for i, e in enumerate(r.bank)}
    assert [[index_of[id(e)] for e in row] for row in got] == [list(w) for w in want]
    for row_s, w, q in zip(scores, want, zq):
        np.testing.assert_allclose(row_s, zd[w] @ q, atol=1e-5)
        assert row_s == sorted(row_s, reverse=True)


def test_self_exclusion(embedder, bank):
    r = Retriever(bank, embedder)
    entry = next(e for e in bank if r.count_by_task[e["task_id"]] == 2)  # a task with two successful rollouts
    # query with a bank entry's own doc-like text so that it would be its own nearest neighbour
    r.query_cache[entry["task_id"]] = embedder.embed_docs([entry])[0]
    with_self = r.retrieve([entry["task_id"]], n_ret=3, exclude_self=False)[0]
    without = r.retrieve([entry["task_id"]], n_ret=3, exclude_self=True)[0]
    assert with_self[0] is entry
    assert all(e["task_id"] != entry["task_id"] for e in without)
    big = r.retrieve([entry["task_id"]], n_ret=len(bank) - r.count_by_task[entry["task_id"]])[0]
    assert all(e["task_id"] != entry["task_id"] for e in big)


@pytest.mark.parametrize("kwarg, same, n_ret, error", [("exclude_variants", False, 4, "of variant"),
                                                      ("only_variants", True, 2, "not of variant")])
def test_variant_controls_match_brute_force(embedder, bank, kwarg, same, n_ret, error):
    """The other-variant control (train.py --retrieval other: never the query's variant) and the same-shop oracle
    (--retrieval shop: only the query's variant): brute force over the entries the control allows."""
    r = Retriever(bank, embedder)
    queries = make_candidates()[::2]
    ids, tasks = [q["task_id"] for q in queries], [q["task"] for q in queries]
    variants = [q["meta"]["variant"] for q in queries]
    got = r.retrieve(ids, tasks, n_ret=n_ret, **{kwarg: variants})
    zq, zd = embedder.embed_queries(tasks), embedder.embed_docs(bank)
    index_of = {id(e): i for i, e in enumerate(r.bank)}
    for row, q, v, tid in zip(got, zq, variants, ids):
        assert len(row) == n_ret and all((e["meta"]["variant"] == v) == same for e in row)
        allowed = [i for i in np.argsort(-(zd @ q), kind="stable") if (bank[i]["meta"]["variant"] == v) == same
                   and bank[i]["task_id"] != tid]
        assert [index_of[id(e)] for e in row] == allowed[:n_ret]
    n_allowed = sum((e["meta"]["variant"] == variants[0]) == same and e["task_id"] != ids[0] for e in bank)
    with pytest.raises(ValueError, match=error):
        r.retrieve(ids[:1], tasks[:1], n_ret=n_allowed + 1, **{kwarg: variants[:1]})
    assert len(r.retrieve(ids[:1], tasks[:1], n_ret=n_allowed, **{kwarg: variants[:1]})[0]) == n_allowed


def test_empty_and_too_small_bank(embedder, bank):
    with pytest.raises(ValueError, match="experience bank is empty"):
        Retriever([], embedder)
    twice = next(e for e in bank if sum(f["task_id"] == e["task_id"] for f in bank) == 2)
    small = [e for e in bank if e["task_id"] == twice["task_id"]] + [bank[-1]]  # 2 of one task + 1 other
    r = Retriever(small, embedder)
    assert len(r.retrieve([twice["task_id"]], [twice["task"]], n_ret=1)[0]) == 1
    with pytest.raises(ValueError, match="n_ret=2 but the bank holds 3 entries"):
        r.retrieve([twice["task_id"]], [twice["task"]], n_ret=2)
    assert len(r.retrieve(["other"], ["x"], n_ret=len(small))[0]) == len(small)
    with pytest.raises(ValueError, match=f"n_ret={len(small) + 1} but the bank holds {len(small)}"):
        r.retrieve(["other"], ["x"], n_ret=len(small) + 1)


def test_save_load_round_trip(tmp_path, embedder, bank):
    r = Retriever(bank, embedder)
    queries = make_candidates()[1::3]
    ids, tasks = [q["task_id"] for q in queries], [q["task"] for q in queries]
    before = r.retrieve(ids, tasks, n_ret=3, return_scores=True)
    r.save(str(tmp_path / "ret"))
    assert sorted(os.listdir(tmp_path / "ret")) == ["bank.jsonl", "index.faiss", "meta.json", "query_cache.npz"]
    meta = json.loads((tmp_path / "ret" / "meta.json").read_text())
    assert meta["dim"] == 32 and meta["pooling"] == "last" and meta["embedder"] == embedder.name
    loaded = Retriever.load(str(tmp_path / "ret"))  # no embedder: cached queries only
    np.testing.assert_array_equal(loaded.doc_vectors(), r.doc_vectors())
    assert loaded.retrieve(ids, n_ret=3, return_scores=True) == before
    with pytest.raises(ValueError, match="not cached"):
        loaded.retrieve(["never-seen"], ["cancel the order of ben at birch"], n_ret=3)
    with_emb = Retriever.load(str(tmp_path / "ret"), embedder=embedder)
    assert len(with_emb.retrieve(["never-seen"], ["cancel the order of ben at birch"], n_ret=3)[0]) == 3
    with pytest.warns(UserWarning, match="embedder differs"):
        Retriever.load(str(tmp_path / "ret"), embedder=Embedder.from_model(embedder.model, embedder.tokenizer,
                                                                           pooling="mean"))


def test_recall_at_k_and_ties_by_hand():
    """Hand-made 2-d vectors: recall@k counts the relevant fraction of the top-k; ties go by bank position."""
    bank = [retrieval.make_entry(f"t{i}", f"task {i}", "1. a -> b", 1.0, {"schema": s})
            for i, s in enumerate(["x", "x", "y", "y"])]
    docs = np.array([[1, 0], [0.6, 0.8], [1, 0], [0, 1]], dtype=np.float32)  # (N, 2); entries 0 and 2 tie
    r = Retriever(bank, doc_vectors=docs)
    r.query_cache = {"q": np.array([1, 0], np.float32), "t0": np.array([0, 1], np.float32)}
    got, s = r.retrieve(["q"], n_ret=3, return_scores=True)
    assert [e["task_id"] for e in got[0]] == ["t0", "t2", "t1"] and s[0] == pytest.approx([1, 1, 0.6])
    queries = [{"task_id": "q", "task": "", "meta": {"schema": "x"}},
               {"task_id": "t0", "task": "", "meta": {"schema": "x"}}]
    same = lambda q, e: q["meta"]["schema"] == e["meta"]["schema"]  # noqa: E731
    # q: top-2 = t0 (x), t2 (y) -> 1/2;  t0 (self excluded): top-2 = t3 (y), t1 (x) -> 1/2
    assert retrieval.recall_at_k(r, queries, 2, same) == pytest.approx(0.5)
    # k=1: q -> t0 (x) = 1; t0 -> t3 (y) = 0
    assert retrieval.recall_at_k(r, queries, 1, same) == pytest.approx(0.5)


def test_missing_faiss_fails_only_when_building(monkeypatch, bank):
    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(ImportError, match="pip install faiss-cpu"):
        Retriever(bank, doc_vectors=np.eye(len(bank), dtype=np.float32))


def test_bank_recall_takes_the_self_exclusion_into_account():
    """retrieval.bank_recall on a bank of 3 whose test task also trained (2 of its own entries there): recall@3 would ask
    for 3 entries of other tasks where 1 exists, and raised 'experience bank too small'; k is now what the bank
    holds beside the task's own entries, by hand: 1 entry, of the same schema."""
    import train
    from worlds.tool_world import Task
    bank = [retrieval.make_entry(tid, "t", "1. a -> b", 1.0, {"schema": s, "variant": "v"})
            for tid, s in (("both", "x"), ("both", "x"), ("other", "x"))]
    r = Retriever(bank, doc_vectors=np.eye(3, 2, dtype=np.float32))
    r.query_cache = {"both": np.array([1, 0], np.float32)}
    test = [Task("both", "v", "x", "t", {}, {}, [])]
    got = retrieval.bank_recall(r, test)
    assert got["recall3_schema"] == 1.0 and got["recall3_variant"] == 1.0 and got["schemas_in_bank"] == 1
    with pytest.raises(ValueError, match="experience bank too small"):       # what a k of 3 would ask
        retrieval.recall_at_k(r, [{"task_id": "both", "task": "t"}], 3, lambda q, e: True)
