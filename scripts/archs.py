"""The paper's backbones as configs (random weights, no download), and the cards they are planned for: what
scripts/bench.py and scripts/gpu_check.py share (bench imports the GPU check, so the check cannot import bench)."""

ARCHS = {  # published config.json values of each backbone
    "qwen3-4b": ("qwen3", dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                               max_position_embeddings=40960)),
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                               max_position_embeddings=40960)),
    "olmo3-7b": ("olmo3", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=32, vocab_size=100278, tie_word_embeddings=False)),
}
SMOLLM2 = ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192))     # the real-model tier's SmolLM2-135M-Instruct
H200_BYTES = 143_771 * 2**20     # what nvidia-smi reports for one H200
H100_BYTES = 81_559 * 2**20      # and for one H100 80 GB (HBM3)
CUDA_CONTEXT = 1e9               # CUDA's own context and torch's workspaces, roughly
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}   # dense bf16 FLOP/s


def arch_config(name: str):
    """The config of ARCHS[name] (or SmolLM2's, "smollm2-135m"), from its published values: nothing downloaded."""
    from transformers import AutoConfig
    kind, kw = SMOLLM2 if name == "smollm2-135m" else ARCHS[name]
    return AutoConfig.for_model(kind, **kw)
