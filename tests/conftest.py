"""Shared fixtures: tiny models on a shared 2-core machine, and the offline toy tokenizer."""
import pytest
import torch

import toy


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run ~5x faster on one intra-op thread when the two cores are shared; restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    """The toy tokenizer (byte-level BPE, ChatML tokens, Qwen3-style template) trained on a small corpus."""
    return toy.build_tokenizer(toy.corpus_texts(toy.demo_tasks(60, 0), 0))
