"""`tandem bench --compare-hf`: Hugging Face transformers' greedy `generate` on the same weights, in the
same process, on the same prompts.

Real checkpoints load with `from_pretrained`, independently of tandem's loader. Random-weight presets
have nothing on disk, so the transformers model is built from the same config.json and given
tandem's own tensors, with the merged projections (q/k/v, gate/up) split back into their Hugging
Face names.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from tandem.bench.measure import RunMetrics
from tandem.layers.linear import MergedLinear
from tandem.models.llama import PACKED_MODULES
from tandem.models.loader import default_dtype


def build_hf_model(engine, copy_weights: bool) -> nn.Module:
    """The transformers model of `engine`'s target, in its dtype and on its device."""
    import transformers

    path, dtype, device = engine.args.model_path, engine.runner.dtype, engine.runner.device
    if copy_weights:
        config = transformers.AutoConfig.from_pretrained(path)
        model_cls = getattr(transformers, config.architectures[0])
        from transformers.modeling_utils import no_init_weights

        with torch.device(device), default_dtype(dtype), no_init_weights():  # every parameter is overwritten
            model = model_cls(config)
        model.tie_weights()  # skipped with the initialisation: without it a tied lm_head stays garbage
        load_tandem_weights(model, engine.runner.model)
    else:
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **{dtype_kw: dtype}).to(device)
    # No EOS: every row runs exactly output_len tokens, as tandem's ignore_eos requests do.
    model.generation_config = transformers.GenerationConfig()
    return model.eval()


def hf_state_dict(tandem_model: nn.Module) -> dict[str, torch.Tensor]:
    """tandem's parameters under Hugging Face names (views, no copies)."""
    unpack = {(merged, shard): fragment for fragment, (merged, shard) in PACKED_MODULES.items()}
    modules = dict(tandem_model.named_modules())
    out = {}
    for name, param in tandem_model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = modules[module_name]
        if not isinstance(module, MergedLinear):
            out[name] = param.detach()
            continue
        parent, _, merged = module_name.rpartition(".")
        for shard, (offset, size) in module.shard_offsets.items():
            out[f"{parent}.{unpack[(merged, shard)]}.{leaf}"] = param.detach().narrow(0, offset, size)
    return out


def load_tandem_weights(hf_model: nn.Module, tandem_model: nn.Module) -> None:
    missing, unexpected = hf_model.load_state_dict(hf_state_dict(tandem_model), strict=False)
    if getattr(hf_model.config, "tie_word_embeddings", False):
        if hf_model.get_output_embeddings().weight is not hf_model.get_input_embeddings().weight:
            raise ValueError("transformers model: lm_head is not tied to the embedding")
        missing = [m for m in missing if m != "lm_head.weight"]  # it is the embedding
    if missing or unexpected:
        raise ValueError(f"tandem -> transformers weights: missing {missing}, unexpected {unexpected}")


@torch.inference_mode()
def run_hf(model: nn.Module, prompts: list[list[int]], output_len: int) -> tuple[RunMetrics, list[list[int]]]:
    """Greedy `generate` on equal-length prompts (no padding). Prefill is timed by a separate
    one-token call, so ms per output token excludes it as tandem's does."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def timed(n: int):
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
        _sync(device)
        return out, time.perf_counter() - t0

    _, prefill_s = timed(1)
    out, total_s = timed(output_len)
    tokens = out[:, ids.shape[1]:].tolist()
    n_out = sum(len(t) for t in tokens)
    per_token_ms = 1e3 * (total_s - prefill_s) / (output_len - 1)
    metrics = RunMetrics(batch_size=len(prompts), output_tokens=n_out, total_s=total_s,
                         tokens_per_s=n_out / total_s, ttft_ms=1e3 * prefill_s, ms_per_output_token=per_token_ms,
                         iteration_ms=per_token_ms, decode_iterations=output_len - 1)
    return metrics, tokens


def token_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Share of requests whose tokens are all equal, and the first position where any differs."""
    same = sum(a == b for a, b in zip(ours, theirs))
    first = min((next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                 for a, b in zip(ours, theirs) if a != b), default=None)
    return {"requests_equal": same / len(ours), "first_difference_at": first}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
