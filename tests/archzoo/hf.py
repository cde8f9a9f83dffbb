"""Hugging Face transformers models built from tiny configs with random weights.

Every builder works on transformers 4.57 and 5.x: hidden 32, 2 layers, 4 heads,
intermediate 64, vocabulary 128, sequences of 16, batch 4. Every dropout-like
option of the config (and of its sub-configs) is 0, the cache is off, and the
attention is SDPA where the model class supports it on the installed line
(eager otherwise). The weights come from ``torch.manual_seed(0)``; nothing is
downloaded and ``transformers`` is imported inside the builders. No labels go
into the model: the loss is computed from the outputs' logits, averaged over
the batch.

:data:`GRAPH_BREAKS` names the models that ``torch.compile(fullgraph=True)``
cannot capture as one graph, with where and on which transformers line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from orgel.models import ZooWorkload

BATCH, SEQ, VOCAB, HIDDEN = 4, 16, 128, 32
#: Parts of a config option's name that make it a dropout-like probability (set to 0).
_DROPOUT_WORDS = ("dropout", "pdrop", "layerdrop", "drop_path", "jitter_noise")

_LAYERDROP = ("4.x only: `if dropout_probability < self.layerdrop` on a `torch.rand([])` drawn "
              "for every layer in training, even at layerdrop 0")
#: name -> where ``torch.compile(model, fullgraph=True, backend="eager")(**inputs)`` stops and
#: on which transformers line (checked with torch 2.13, transformers 4.57.6 and 5.23.0); every
#: other builder is one graph on both lines.
GRAPH_BREAKS: dict[str, str] = {
    "hf_bigbird": "4.x and 5.x: block-sparse attention plans its random blocks with NumPy "
                  "(`curr_r_cnt = int(np.sum(plan_num_rand_blocks[...]))`)",
    "hf_longformer": "4.x and 5.x: `logger.warning_once` in the forward; with log calls "
                     "skipped, `if is_global_attn:` on `.any().item()` of the global mask",
    "hf_reformer": "4.x and 5.x: `input_shape[-1] % least_common_mult_chunk_length` with a "
                   "NumPy `np.lcm` chunk length; then `torch.manual_seed` in the reversible layers",
    "hf_opt": _LAYERDROP,
    "hf_bart": _LAYERDROP,
    "hf_whisper": _LAYERDROP,
    "hf_mixtral": "4.x only: `for expert_idx in expert_hit` loops over the experts that some "
                  "token chose",
}


def _configs(config: Any) -> list[Any]:
    """``config`` and its sub-configs (CLIP's text and vision towers)."""
    subs = [getattr(config, name, None) for name in ("text_config", "vision_config")]
    return [config] + [sub for sub in subs if sub is not None]


def _config(cls: Any, **options: Any) -> Any:
    """``cls(**options)`` with every dropout-like probability 0 and no cache."""
    config = cls(**options)
    for part in _configs(config):
        for name, value in list(vars(part).items()):
            droppy = any(word in name for word in _DROPOUT_WORDS)
            if droppy and (value is None or type(value) in (int, float)):
                setattr(part, name, 0.0)
        if hasattr(part, "use_cache"):
            part.use_cache = False
    return config


def _build(model_cls: Any, config: Any, inputs: dict[str, torch.Tensor], targets: Any,
           loss_fn: Callable[[Any, Any], torch.Tensor]) -> ZooWorkload:
    """``model_cls(config)`` from seed 0 with SDPA attention if it has it, in train mode."""
    attention = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
    for part in _configs(config):
        part._attn_implementation = attention
    torch.manual_seed(0)
    model = model_cls(config)
    model.train()
    return ZooWorkload(model, inputs, targets, loss_fn)


def _tokens(seed: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(input_ids, next_ids)`` of shape ``(BATCH, seq)``, ids 2.. (0 and 1 special)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (BATCH, seq + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _labels(seed: int, classes: int = 3) -> torch.Tensor:
    """Random class labels, one per sample."""
    return torch.randint(0, classes, (BATCH,), generator=torch.Generator().manual_seed(seed))


def _pixels(seed: int, size: int = 16, channels: int = 3) -> torch.Tensor:
    """Random images ``(BATCH, channels, size, size)``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, channels, size, size, generator=gen)


def lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position's logits against ``targets`` (causal and seq2seq LMs)."""
    return F.cross_entropy(output.logits.flatten(0, -2), targets.flatten())


def cls_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a classification head's logits."""
    return F.cross_entropy(output.logits, labels)


def clip_loss(output: Any, weights: torch.Tensor) -> torch.Tensor:
    """Contrastive loss within the (micro-)batch: image ``i`` matches text ``i`` (and back).

    The targets are ``arange`` of the (micro-)batch size. ``weights`` (one per
    sample) scale each sample's two terms; they carry the batch dimension so
    that micro-batches slice them like the inputs.
    """
    matches = torch.arange(output.logits_per_image.shape[0])
    per_sample = (F.cross_entropy(output.logits_per_image, matches, reduction="none")
                  + F.cross_entropy(output.logits_per_text, matches, reduction="none")) / 2
    return (per_sample * weights).mean()


# -- causal language models: input_ids in, next-token cross-entropy ------------------------

def _decoder(config_name: str, model_name: str, seed: int, **options: Any) -> ZooWorkload:
    """A causal LM of ``transformers.<model_name>``: ``input_ids`` in, next-token loss."""
    import transformers

    config = _config(getattr(transformers, config_name), vocab_size=VOCAB,
                     max_position_embeddings=SEQ * 2, bos_token_id=0, eos_token_id=1,
                     pad_token_id=1, tie_word_embeddings=False, **options)
    ids, targets = _tokens(seed)
    return _build(getattr(transformers, model_name), config, {"input_ids": ids}, targets,
                  lm_loss)


_LLAMA_LIKE = {"hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2}


def hf_gpt2() -> ZooWorkload:
    """GPT2LMHeadModel (tied head), 2 layers of 32; 4.x builds its masks with torch.vmap."""
    import transformers

    config = _config(transformers.GPT2Config, vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN,
                     n_layer=2, n_head=4, n_inner=64, bos_token_id=0, eos_token_id=1)
    ids, targets = _tokens(1)
    return _build(transformers.GPT2LMHeadModel, config, {"input_ids": ids}, targets, lm_loss)


def hf_gpt_neo() -> ZooWorkload:
    """GPTNeoForCausalLM, 2 layers of 32: one global, one local attention (window 8)."""
    return _decoder("GPTNeoConfig", "GPTNeoForCausalLM", 2, hidden_size=HIDDEN, num_layers=2,
                    num_heads=4, intermediate_size=64,
                    attention_types=[[["global", "local"], 1]], window_size=8)


def hf_gptj() -> ZooWorkload:
    """GPTJForCausalLM, 2 layers of 32: rotary on 4 of each head's 8 dims, parallel MLP."""
    import transformers

    config = _config(transformers.GPTJConfig, vocab_size=VOCAB, n_positions=SEQ * 2,
                     n_embd=HIDDEN, n_layer=2, n_head=4, n_inner=64, rotary_dim=4,
                     bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    ids, targets = _tokens(3)
    return _build(transformers.GPTJForCausalLM, config, {"input_ids": ids}, targets, lm_loss)


def hf_opt() -> ZooWorkload:
    """OPTForCausalLM, 2 layers of 32."""
    return _decoder("OPTConfig", "OPTForCausalLM", 4, hidden_size=HIDDEN, num_hidden_layers=2,
                    ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=HIDDEN)


def hf_llama() -> ZooWorkload:
    """LlamaForCausalLM, 2 layers of 32, 2 key-value heads; 4.x turns autocast off in rotary."""
    return _decoder("LlamaConfig", "LlamaForCausalLM", 5, **_LLAMA_LIKE)


def hf_mistral() -> ZooWorkload:
    """MistralForCausalLM, 2 layers of 32, 2 key-value heads, a sliding window of 8."""
    return _decoder("MistralConfig", "MistralForCausalLM", 6, sliding_window=8, **_LLAMA_LIKE)


def hf_qwen2() -> ZooWorkload:
    """Qwen2ForCausalLM, 2 layers of 32, 2 key-value heads (biased q/k/v projections)."""
    return _decoder("Qwen2Config", "Qwen2ForCausalLM", 7, **_LLAMA_LIKE)


def hf_mixtral() -> ZooWorkload:
    """MixtralForCausalLM, 2 layers of 32: a mixture of 4 experts, top-2 routing."""
    return _decoder("MixtralConfig", "MixtralForCausalLM", 8, num_local_experts=4,
                    num_experts_per_tok=2, **_LLAMA_LIKE)


def hf_phi() -> ZooWorkload:
    """PhiForCausalLM, 2 layers of 32 (partial rotary, parallel attention and MLP)."""
    return _decoder("PhiConfig", "PhiForCausalLM", 9, hidden_size=HIDDEN, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4)


def hf_gemma() -> ZooWorkload:
    """GemmaForCausalLM, 2 layers of 32 (scaled embeddings, RMSNorm with a +1 weight)."""
    return _decoder("GemmaConfig", "GemmaForCausalLM", 10, head_dim=8, **_LLAMA_LIKE)


def hf_falcon() -> ZooWorkload:
    """FalconForCausalLM, 2 layers of 32: new decoder architecture, 2 key-value heads, rotary."""
    return _decoder("FalconConfig", "FalconForCausalLM", 11, hidden_size=HIDDEN,
                    num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                    new_decoder_architecture=True, parallel_attn=True, bias=False, alibi=False)


def hf_reformer() -> ZooWorkload:
    """ReformerModelWithLMHead, 32 wide: a local and an LSH attention layer (chunks of 4).

    Reversible layers (the backward recomputes the forward), axial position
    embeddings 4x4 (training needs their product to be the sequence length),
    4 hash buckets with ``hash_seed=0`` so that the hashing is deterministic.
    Every training forward reseeds torch's global RNG (``torch.seed()`` for the
    dropout of the recomputation, ``manual_seed(hash_seed)`` for the hashing).
    On 5.x ``lm_head.bias`` is a parameter the forward never uses.
    """
    import transformers

    config = _config(transformers.ReformerConfig, vocab_size=VOCAB, hidden_size=HIDDEN,
                     num_attention_heads=4, attention_head_size=8, feed_forward_size=64,
                     attn_layers=["local", "lsh"], axial_pos_embds=True, axial_pos_shape=[4, 4],
                     axial_pos_embds_dim=[16, 16], max_position_embeddings=SEQ,
                     local_attn_chunk_length=4, lsh_attn_chunk_length=4, num_buckets=4,
                     num_hashes=1, hash_seed=0, is_decoder=True, chunk_size_lm_head=0,
                     pad_token_id=1, eos_token_id=1, tie_word_embeddings=False)
    ids, targets = _tokens(12)
    return _build(transformers.ReformerModelWithLMHead, config, {"input_ids": ids}, targets,
                  lm_loss)


# -- encoders: input_ids in, cross-entropy over 3 classes ----------------------------------

def _encoder(config_name: str, model_name: str, seed: int, seq: int = SEQ,
             **options: Any) -> ZooWorkload:
    """A sequence classifier of ``transformers.<model_name>`` over 3 labels."""
    import transformers

    options = {"max_position_embeddings": seq + 2, **options}
    config = _config(getattr(transformers, config_name), vocab_size=VOCAB, num_labels=3,
                     pad_token_id=1, **options)
    ids, _ = _tokens(seed, seq)
    return _build(getattr(transformers, model_name), config, {"input_ids": ids}, _labels(seed),
                  cls_loss)


_BERT_LIKE = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 64}


def hf_bert() -> ZooWorkload:
    """BertForSequenceClassification, 2 layers of 32."""
    return _encoder("BertConfig", "BertForSequenceClassification", 20, **_BERT_LIKE)


def hf_roberta() -> ZooWorkload:
    """RobertaForSequenceClassification, 2 layers of 32 (position ids from the padding)."""
    return _encoder("RobertaConfig", "RobertaForSequenceClassification", 21, **_BERT_LIKE)


def hf_distilbert() -> ZooWorkload:
    """DistilBertForSequenceClassification, 2 layers of 32."""
    return _encoder("DistilBertConfig", "DistilBertForSequenceClassification", 22, dim=HIDDEN,
                    n_layers=2, n_heads=4, hidden_dim=64)


def hf_albert() -> ZooWorkload:
    """AlbertForSequenceClassification, 4 layers of 32 sharing one layer's weights."""
    return _encoder("AlbertConfig", "AlbertForSequenceClassification", 23, embedding_size=16,
                    hidden_size=HIDDEN, num_hidden_layers=4, num_hidden_groups=1,
                    num_attention_heads=4, intermediate_size=64)


def hf_electra() -> ZooWorkload:
    """ElectraForSequenceClassification, 2 layers of 32 over 16-wide embeddings."""
    return _encoder("ElectraConfig", "ElectraForSequenceClassification", 24, embedding_size=16,
                    **_BERT_LIKE)


def hf_mobilebert() -> ZooWorkload:
    """MobileBertForSequenceClassification, 2 layers of 32: 16-wide bottlenecks, 2 FFNs each."""
    return _encoder("MobileBertConfig", "MobileBertForSequenceClassification", 25,
                    embedding_size=16, true_hidden_size=16, intra_bottleneck_size=16,
                    num_feedforward_networks=2, **_BERT_LIKE)


def hf_deberta_v2() -> ZooWorkload:
    """DebertaV2ForSequenceClassification, 2 layers of 32 (disentangled relative attention)."""
    return _encoder("DebertaV2Config", "DebertaV2ForSequenceClassification", 26,
                    max_relative_positions=SEQ, position_buckets=8, **_BERT_LIKE)


def hf_bigbird() -> ZooWorkload:
    """BigBirdForSequenceClassification, 2 layers of 32, block-sparse attention over 64 tokens.

    Blocks of 4 with 1 random block: 64 tokens is more than the
    (5 + 2 * 1) * 4 = 28 under which BigBird falls back to full attention, so
    the block-sparse path runs. Its random blocks come from NumPy's global RNG,
    reseeded with the layer's index on every training forward (deterministic,
    but it resets ``np.random``). The classifier reads token 0, so the pooler
    gets no gradient.
    """
    return _encoder("BigBirdConfig", "BigBirdForSequenceClassification", 27, seq=64,
                    max_position_embeddings=64, attention_type="block_sparse", block_size=4,
                    num_random_blocks=1, **_BERT_LIKE)


def hf_longformer() -> ZooWorkload:
    """LongformerForSequenceClassification, 2 layers of 32, attention window 4, global CLS."""
    return _encoder("LongformerConfig", "LongformerForSequenceClassification", 28,
                    attention_window=4, **_BERT_LIKE)


# -- encoder-decoders: encoder inputs and decoder_input_ids in, next-token loss ------------

def _seq2seq(config_name: str, model_name: str, seed: int, inputs: dict[str, torch.Tensor],
             **options: Any) -> ZooWorkload:
    """An encoder-decoder LM of ``transformers.<model_name>``, 16 decoder tokens."""
    import transformers

    config = _config(getattr(transformers, config_name), vocab_size=VOCAB, pad_token_id=1,
                     decoder_start_token_id=0, bos_token_id=0, eos_token_id=1, **options)
    dec, targets = _tokens(seed + 100)
    return _build(getattr(transformers, model_name), config,
                  {**inputs, "decoder_input_ids": dec}, targets, lm_loss)


def hf_t5() -> ZooWorkload:
    """T5ForConditionalGeneration, 2+2 layers of 32 (relative position buckets, tied head)."""
    ids, _ = _tokens(30)
    return _seq2seq("T5Config", "T5ForConditionalGeneration", 30, {"input_ids": ids},
                    d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                    relative_attention_num_buckets=8)


def hf_bart() -> ZooWorkload:
    """BartForConditionalGeneration, 2+2 layers of 32."""
    ids, _ = _tokens(31)
    return _seq2seq("BartConfig", "BartForConditionalGeneration", 31, {"input_ids": ids},
                    d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                    max_position_embeddings=SEQ * 2)


def hf_whisper() -> ZooWorkload:
    """WhisperForConditionalGeneration, 2+2 layers of 32, on 16 mel bins x 32 frames."""
    gen = torch.Generator().manual_seed(32)
    features = torch.randn(BATCH, 16, 2 * 16, generator=gen)
    return _seq2seq("WhisperConfig", "WhisperForConditionalGeneration", 32,
                    {"input_features": features}, d_model=HIDDEN, encoder_layers=2,
                    decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                    encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                    max_source_positions=16, max_target_positions=SEQ * 2,
                    apply_spec_augment=False, begin_suppress_tokens=None, suppress_tokens=None)


# -- vision and multimodal ------------------------------------------------------------------

def hf_vit() -> ZooWorkload:
    """ViTForImageClassification, 2 layers of 32, on 16x16 images in patches of 4."""
    import transformers

    config = _config(transformers.ViTConfig, image_size=16, patch_size=4, num_labels=3,
                     **_BERT_LIKE)
    return _build(transformers.ViTForImageClassification, config, {"pixel_values": _pixels(40)},
                  _labels(40), cls_loss)


def hf_swin() -> ZooWorkload:
    """SwinForImageClassification on 16x16 images: patches of 2, shifted windows of 2, 2 stages."""
    import transformers

    config = _config(transformers.SwinConfig, image_size=16, patch_size=2, embed_dim=16,
                     depths=[2, 2], num_heads=[2, 4], window_size=2, num_labels=3)
    return _build(transformers.SwinForImageClassification, config, {"pixel_values": _pixels(41)},
                  _labels(41), cls_loss)


def hf_convnext() -> ZooWorkload:
    """ConvNextForImageClassification on 32x32 images, 2 stages of 16 and 32 channels."""
    import transformers

    config = _config(transformers.ConvNextConfig, num_channels=3, num_stages=2,
                     hidden_sizes=[16, 32], depths=[2, 2], num_labels=3)
    return _build(transformers.ConvNextForImageClassification, config,
                  {"pixel_values": _pixels(42, size=32)}, _labels(42), cls_loss)


def hf_clip() -> ZooWorkload:
    """CLIPModel: 2-layer text and vision towers of 32 meeting at 16-wide contrastive logits."""
    import transformers

    text = {"vocab_size": VOCAB, "max_position_embeddings": SEQ, "bos_token_id": 0,
            "eos_token_id": 1, "pad_token_id": 1, **_BERT_LIKE}
    vision = {"image_size": 16, "patch_size": 4, **_BERT_LIKE}
    config = _config(transformers.CLIPConfig, text_config=text, vision_config=vision,
                     projection_dim=16)
    ids, _ = _tokens(43)
    inputs = {"input_ids": ids, "pixel_values": _pixels(43)}
    return _build(transformers.CLIPModel, config, inputs, torch.ones(BATCH), clip_loss)


BUILDERS: dict[str, Callable[[], ZooWorkload]] = {
    build.__name__: build
    for build in (
        hf_gpt2, hf_gpt_neo, hf_gptj, hf_opt, hf_llama, hf_mistral, hf_qwen2, hf_mixtral,
        hf_phi, hf_gemma, hf_falcon, hf_reformer,
        hf_bert, hf_roberta, hf_distilbert, hf_albert, hf_electra, hf_mobilebert, hf_deberta_v2,
        hf_bigbird, hf_longformer,
        hf_t5, hf_bart, hf_whisper,
        hf_vit, hf_swin, hf_convnext, hf_clip,
    )
}

__all__ = ["BUILDERS", "GRAPH_BREAKS", "clip_loss", "cls_loss", "lm_loss"]
