"""MTP draft heads: DeepSeek-V3-style multi-token-prediction ("next-n") modules on a Llama-family target.

Checkpoint format (a directory):
  config.json   Llama-family fields of the target's shape (hidden_size, num_attention_heads,
                num_key_value_heads, intermediate_size, rms_norm_eps, rope_theta, rope_scaling, ...),
                `num_nextn_predict_layers: n`, and an architectures entry such as
                ["LlamaForCausalLMMTP"] (read as Llama whatever it says).
  *.safetensors (or pytorch_model*.bin), for each module k in 0..n-1, under `model.layers.{k}.`:
                enorm.weight [H], hnorm.weight [H], eh_proj.weight [H, 2H],
                the Llama decoder block: self_attn.{q,k,v,o}_proj.weight, mlp.{gate,up,down}_proj.weight,
                input_layernorm.weight, post_attention_layernorm.weight,
                shared_head.norm.weight [H], optional shared_head.head.weight [V, H] (absent: the
                target's lm_head).
                Embeddings come from the target; any `*embed_tokens.weight` stored is ignored.

Module k at position t consumes token x[t+k+1] and the previous module's output there:
    h_k,t = block_k(eh_proj(cat[enorm(embed(x[t+k+1])), hnorm(h_k-1,t)]))
    logits_k,t = head(shared_head.norm(h_k,t))          predicts x[t+k+2]
h_-1,t is the target's final hidden state at t (after its final norm, EAGLE-1's feature). Each module
is an ordinary pre-norm Llama layer with its own KV cache layer (layer id k). Draft step k+1 runs
module k (speculative/mtp_drafter.py), so a checkpoint with n modules drafts at most n tokens.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from torch import nn

from tandem.config import ModelLoadConfig
from tandem.layers.linear import Linear
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models import llama
from tandem.models.draft_base import DraftModel
from tandem.models.hf_config import ModelArchConfig, parse_model_config
from tandem.models.llama import LlamaDecoderLayer
from tandem.models.loader import checkpoint_files, default_dtype, init_dummy_weights, iter_checkpoint, load_weights


class SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float, own_head: bool):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.head = Linear(hidden, vocab, bias=False) if own_head else None


class MTPLayer(LlamaDecoderLayer):
    """One next-n module: the projection of (token, previous hidden) into an ordinary Llama block.
    Its parameter names are the checkpoint's, under `model.layers.{k}.`."""

    def __init__(self, cfg: ModelArchConfig, layer_id: int, rotary: RotaryEmbedding, own_head: bool):
        super().__init__(cfg, layer_id, rotary)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(h, cfg.vocab_size, cfg.rms_norm_eps, own_head)

    def forward(self, positions, embeds, hidden, ctx):
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out, residual = super().forward(positions, x, ctx)
        return out + residual


class _Layers(nn.Module):
    def __init__(self, layers: list[MTPLayer], rotary: RotaryEmbedding):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.rotary = rotary  # shared by every module; buffers only


class MTPDraft(DraftModel):
    token_offset = 1  # module 0 pairs x[t+1] with the target's hidden at t, like EAGLE
    target_hidden = "final"

    def __init__(self, cfg: ModelArchConfig, target, max_positions: int, num_modules: int,
                 own_heads: list[bool]):
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.model = _Layers([MTPLayer(cfg, k, rotary, own_heads[k]) for k in range(num_modules)], rotary)
        # Shared with the target, not owned: plain callables so they are not registered as submodules.
        self._embed = target.embed
        self._target_logits = target.compute_logits

    @property
    def num_modules(self) -> int:
        return len(self.model.layers)

    @property
    def num_kv_layers(self) -> int:
        return self.num_modules

    def forward_module(self, k: int, input_ids, positions, hidden, ctx) -> torch.Tensor:
        """Module k over tokens [N] at `positions` [N] with the previous module's (or the target's)
        hidden [N, H]; returns h_k [N, H]."""
        return self.model.layers[k](positions, self._embed(input_ids), hidden, ctx)

    def module_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        shared = self.model.layers[k].shared_head
        normed = shared.norm(hidden)
        return self._target_logits(normed) if shared.head is None else shared.head(normed).float()

    # The generic DraftModel interface is module 0 (the drafter calls the per-module methods).
    def forward(self, input_ids, positions, hidden, ctx, hidden_is_target):
        return self.forward_module(0, input_ids, positions, hidden, ctx)

    def compute_logits(self, hidden):
        return self.module_logits(0, hidden)


def mtp_config(path: str) -> tuple[ModelArchConfig, int]:
    """The block geometry and n (`num_nextn_predict_layers`) of an MTP checkpoint directory."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in MTP draft model directory {path!r}")
    with open(cfg_path) as f:
        raw = json.load(f)
    n = raw.get("num_nextn_predict_layers")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"MTP draft config {cfg_path!r} needs num_nextn_predict_layers >= 1 (got {n!r})")
    # The blocks are Llama layers whatever the architecture string says; num_hidden_layers (the
    # target's depth, if given) plays no part here.
    raw = {"num_hidden_layers": n, **raw, "architectures": ["LlamaForCausalLM"]}
    return parse_model_config(raw), n


def _checkpoint_names(path: str) -> set[str]:
    names = set()
    for f in checkpoint_files(path):
        if f.endswith(".bin"):
            names.update(torch.load(f, map_location="cpu", mmap=True, weights_only=True).keys())
        else:
            with safe_open(f, framework="pt", device="cpu") as handle:
                names.update(handle.keys())
    return names


def _skip_embeddings(name: str) -> str | None:
    return None if name.endswith("embed_tokens.weight") else name  # the target's embedding is used


def build_mtp_draft(path: str, target, load: ModelLoadConfig, max_positions: int) -> MTPDraft:
    cfg, n = mtp_config(path)
    if cfg.hidden_size != target.config.hidden_size or cfg.vocab_size != target.config.vocab_size:
        raise ValueError(f"MTP draft hidden_size/vocab_size ({cfg.hidden_size}, {cfg.vocab_size}) differ from "
                         f"the target's ({target.config.hidden_size}, {target.config.vocab_size})")
    dummy = load.load_format == "dummy"
    names = set() if dummy else _checkpoint_names(path)
    own_heads = [f"model.layers.{k}.shared_head.head.weight" in names for k in range(n)]
    dtype = target.model.embed_tokens.weight.dtype
    with torch.device(load.device), default_dtype(dtype):
        model = MTPDraft(cfg, target, max_positions, n, own_heads)
    if dummy:
        init_dummy_weights(model, load.seed + 1)
    else:
        load_weights(model, iter_checkpoint(path, desc="loading MTP weights"), llama.PACKED_MODULES,
                     rename=_skip_embeddings)
    return model.eval()
