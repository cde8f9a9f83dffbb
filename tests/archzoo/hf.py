"""Hugging Face transformers models built from tiny configs with random weights.

Every builder works on transformers 4.57 and 5.x: hidden 32, 2 layers, 4 heads,
vocabulary 128, sequences of 16, every dropout 0, no cache, SDPA attention
where the model has it on both lines (eager otherwise). Nothing is downloaded;
``transformers`` is imported inside the builders. The loss is computed from the
logits (no labels go into the model), averaged over the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from orgel.models import ZooWorkload

BATCH, SEQ, VOCAB, HIDDEN = 4, 16, 128, 32
#: Every dropout-like option a config may have, all off.
_NO_DROPOUT = {
    name: 0.0 for name in (
        "hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout",
        "hidden_dropout", "attention_dropout", "activation_dropout", "dropout",
        "resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout", "dropout_rate",
        "encoder_layerdrop", "decoder_layerdrop", "layerdrop", "qa_dropout", "seq_classif_dropout",
        "embed_dropout", "lsh_attention_probs_dropout_prob",
        "local_attention_probs_dropout_prob", "drop_path_rate", "router_jitter_noise",
        "projection_dropout", "mlp_dropout", "classifier_dropout_prob",
    )
}


def _config(cls: Any, *, attn: str = "sdpa", **options: Any) -> Any:
    """``cls(**options)`` with every dropout off, no cache and ``attn`` attention."""
    config = cls(**{**_NO_DROPOUT, "use_cache": False, **options})
    config._attn_implementation = attn
    for sub in ("text_config", "vision_config"):
        if hasattr(config, sub):
            getattr(config, sub)._attn_implementation = attn
    return config


def _tokens(seed: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(input_ids, next_ids)`` of shape ``(BATCH, seq)``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (BATCH, seq + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _labels(seed: int, classes: int = 3) -> torch.Tensor:
    return torch.randint(0, classes, (BATCH,), generator=torch.Generator().manual_seed(seed))


def _pixels(seed: int, size: int = 16, channels: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, channels, size, size, generator=gen)


def lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position's logits against ``targets``."""
    return F.cross_entropy(output.logits.flatten(0, -2), targets.flatten())


def cls_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a classification head's logits."""
    return F.cross_entropy(output.logits, labels)


def clip_loss(output: Any, weights: torch.Tensor) -> torch.Tensor:
    """Contrastive loss within the (micro-)batch: image ``i`` matches text ``i`` (and back).

    ``weights`` (one per sample) scale each sample's two terms; it carries the
    batch dimension so that micro-batches slice it like the inputs.
    """
    matches = torch.arange(output.logits_per_image.shape[0])
    per_sample = (F.cross_entropy(output.logits_per_image, matches, reduction="none")
                  + F.cross_entropy(output.logits_per_text, matches, reduction="none")) / 2
    return (per_sample * weights).mean()


def _build(model_cls: Any, config: Any, inputs: dict[str, torch.Tensor], targets: Any,
           loss_fn: Callable[[Any, Any], torch.Tensor]) -> ZooWorkload:
    torch.manual_seed(0)
    model = model_cls(config)
    model.train()
    return ZooWorkload(model, inputs, targets, loss_fn)


def _decoder(config_name: str, model_name: str, seed: int, **options: Any) -> ZooWorkload:
    """A causal LM: ``input_ids`` in, next-token cross-entropy."""
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
    """GPT2LMHeadModel (tied head); 4.x builds its masks with torch.vmap."""
    import transformers

    config = _config(transformers.GPT2Config, vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN,
                     n_layer=2, n_head=4, bos_token_id=0, eos_token_id=1)
    ids, targets = _tokens(1)
    return _build(transformers.GPT2LMHeadModel, config, {"input_ids": ids}, targets, lm_loss)


def hf_gpt_neo() -> ZooWorkload:
    """GPTNeoForCausalLM with a global and a local attention layer."""
    return _decoder("GPTNeoConfig", "GPTNeoForCausalLM", 2, hidden_size=HIDDEN, num_layers=2,
                    num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8,
                    attn="eager")


def hf_opt() -> ZooWorkload:
    """OPTForCausalLM."""
    return _decoder("OPTConfig", "OPTForCausalLM", 3, hidden_size=HIDDEN, num_hidden_layers=2,
                    ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=HIDDEN)


def hf_llama() -> ZooWorkload:
    """LlamaForCausalLM with grouped-query attention; 4.x turns autocast off in its rotary."""
    return _decoder("LlamaConfig", "LlamaForCausalLM", 4, **_LLAMA_LIKE)


def hf_mistral() -> ZooWorkload:
    """MistralForCausalLM with a sliding window."""
    return _decoder("MistralConfig", "MistralForCausalLM", 5, sliding_window=8, **_LLAMA_LIKE)


def hf_qwen2() -> ZooWorkload:
    """Qwen2ForCausalLM (biased q/k/v projections)."""
    return _decoder("Qwen2Config", "Qwen2ForCausalLM", 6, **_LLAMA_LIKE)


def hf_mixtral() -> ZooWorkload:
    """MixtralForCausalLM: 4 experts, top-2 routing."""
    return _decoder("MixtralConfig", "MixtralForCausalLM", 7, num_local_experts=4,
                    num_experts_per_tok=2, **_LLAMA_LIKE)


def hf_phi() -> ZooWorkload:
    """PhiForCausalLM (partial rotary, parallel attention and MLP)."""
    return _decoder("PhiConfig", "PhiForCausalLM", 8, hidden_size=HIDDEN, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4)


def hf_gemma() -> ZooWorkload:
    """GemmaForCausalLM (scaled embeddings, RMSNorm with a +1 weight)."""
    return _decoder("GemmaConfig", "GemmaForCausalLM", 9, head_dim=8, **_LLAMA_LIKE)


def _encoder(config_name: str, model_name: str, seed: int, **options: Any) -> ZooWorkload:
    """A sequence classifier: ``input_ids`` in, cross-entropy over 3 labels."""
    import transformers

    config = _config(getattr(transformers, config_name), vocab_size=VOCAB, num_labels=3,
                     max_position_embeddings=SEQ + 2, pad_token_id=1, **options)
    ids, _ = _tokens(seed)
    return _build(getattr(transformers, model_name), config, {"input_ids": ids}, _labels(seed),
                  cls_loss)


_BERT_LIKE = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 64}


def hf_bert() -> ZooWorkload:
    """BertForSequenceClassification."""
    return _encoder("BertConfig", "BertForSequenceClassification", 10, **_BERT_LIKE)


def hf_roberta() -> ZooWorkload:
    """RobertaForSequenceClassification (position ids from the padding mask)."""
    return _encoder("RobertaConfig", "RobertaForSequenceClassification", 11, **_BERT_LIKE)


def hf_distilbert() -> ZooWorkload:
    """DistilBertForSequenceClassification."""
    return _encoder("DistilBertConfig", "DistilBertForSequenceClassification", 12, dim=HIDDEN,
                    n_layers=2, n_heads=4, hidden_dim=64)


def hf_albert() -> ZooWorkload:
    """AlbertForSequenceClassification: one layer's weights shared by all 4 layers."""
    return _encoder("AlbertConfig", "AlbertForSequenceClassification", 13, embedding_size=16,
                    hidden_size=HIDDEN, num_hidden_layers=4, num_hidden_groups=1,
                    num_attention_heads=4, intermediate_size=64)


def hf_electra() -> ZooWorkload:
    """ElectraForSequenceClassification (embedding projection)."""
    return _encoder("ElectraConfig", "ElectraForSequenceClassification", 14, embedding_size=16,
                    attn="eager", **_BERT_LIKE)


def hf_deberta_v2() -> ZooWorkload:
    """DebertaV2ForSequenceClassification (disentangled relative attention)."""
    return _encoder("DebertaV2Config", "DebertaV2ForSequenceClassification", 15,
                    max_relative_positions=SEQ, position_buckets=8, attn="eager",
                    **_BERT_LIKE)


def hf_bigbird() -> ZooWorkload:
    """BigBirdForSequenceClassification, block-sparse attention over 64 tokens of blocks of 4."""
    import transformers

    config = _config(transformers.BigBirdConfig, vocab_size=VOCAB, num_labels=3,
                     max_position_embeddings=64, attention_type="block_sparse", block_size=4,
                     num_random_blocks=1, pad_token_id=1, attn="eager", **_BERT_LIKE)
    ids, _ = _tokens(16, seq=64)
    return _build(transformers.BigBirdForSequenceClassification, config, {"input_ids": ids},
                  _labels(16), cls_loss)


def hf_longformer() -> ZooWorkload:
    """LongformerForSequenceClassification with an attention window of 4."""
    return _encoder("LongformerConfig", "LongformerForSequenceClassification", 17,
                    attention_window=4, attn="eager", **_BERT_LIKE)


def _seq2seq(config_name: str, model_name: str, seed: int, inputs: dict[str, torch.Tensor],
             **options: Any) -> ZooWorkload:
    """An encoder-decoder LM: encoder inputs and ``decoder_input_ids`` in, next-token loss."""
    import transformers

    config = _config(getattr(transformers, config_name), vocab_size=VOCAB, pad_token_id=1,
                     decoder_start_token_id=0, bos_token_id=0, eos_token_id=1, **options)
    dec, targets = _tokens(seed + 100)
    return _build(getattr(transformers, model_name), config,
                  {**inputs, "decoder_input_ids": dec}, targets, lm_loss)


def hf_t5() -> ZooWorkload:
    """T5ForConditionalGeneration (relative position buckets, tied head)."""
    ids, _ = _tokens(18)
    return _seq2seq("T5Config", "T5ForConditionalGeneration", 18, {"input_ids": ids},
                    d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                    relative_attention_num_buckets=8, attn="eager")


def hf_bart() -> ZooWorkload:
    """BartForConditionalGeneration."""
    ids, _ = _tokens(19)
    return _seq2seq("BartConfig", "BartForConditionalGeneration", 19, {"input_ids": ids},
                    d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                    max_position_embeddings=SEQ * 2)


def hf_whisper() -> ZooWorkload:
    """WhisperForConditionalGeneration on 16 mel bins x 32 frames."""
    gen = torch.Generator().manual_seed(20)
    features = torch.randn(BATCH, 16, 32, generator=gen)
    return _seq2seq("WhisperConfig", "WhisperForConditionalGeneration", 20,
                    {"input_features": features}, d_model=HIDDEN, encoder_layers=2,
                    decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                    encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                    max_source_positions=16, max_target_positions=SEQ * 2,
                    begin_suppress_tokens=None, suppress_tokens=None)


def hf_vit() -> ZooWorkload:
    """ViTForImageClassification on 16x16 images in patches of 4."""
    import transformers

    config = _config(transformers.ViTConfig, image_size=16, patch_size=4, num_labels=3,
                     **_BERT_LIKE)
    return _build(transformers.ViTForImageClassification, config, {"pixel_values": _pixels(21)},
                  _labels(21), cls_loss)


def hf_swin() -> ZooWorkload:
    """SwinForImageClassification: shifted windows of 2 patches, 2 stages."""
    import transformers

    config = _config(transformers.SwinConfig, image_size=16, patch_size=2, embed_dim=16,
                     depths=[2, 2], num_heads=[2, 4], window_size=2, num_labels=3,
                     attn="eager")
    return _build(transformers.SwinForImageClassification, config, {"pixel_values": _pixels(22)},
                  _labels(22), cls_loss)


def hf_convnext() -> ZooWorkload:
    """ConvNextForImageClassification, 2 stages."""
    import transformers

    config = _config(transformers.ConvNextConfig, num_channels=3, num_stages=2,
                     hidden_sizes=[16, 32], depths=[2, 2], num_labels=3, attn="eager")
    return _build(transformers.ConvNextForImageClassification, config,
                  {"pixel_values": _pixels(23, size=32)}, _labels(23), cls_loss)


def hf_clip() -> ZooWorkload:
    """CLIPModel: a text and a vision tower meeting at the contrastive logits."""
    import transformers

    text = {"vocab_size": VOCAB, "max_position_embeddings": SEQ, "bos_token_id": 0,
            "eos_token_id": 1, "pad_token_id": 1, **_BERT_LIKE}
    vision = {"image_size": 16, "patch_size": 4, **_BERT_LIKE}
    config = _config(transformers.CLIPConfig, text_config=text, vision_config=vision,
                     projection_dim=16)
    ids, _ = _tokens(24)
    inputs = {"input_ids": ids, "pixel_values": _pixels(24)}
    return _build(transformers.CLIPModel, config, inputs, torch.ones(BATCH), clip_loss)


BUILDERS: dict[str, Callable[[], ZooWorkload]] = {
    build.__name__: build
    for build in (
        hf_gpt2, hf_gpt_neo, hf_opt, hf_llama, hf_mistral, hf_qwen2, hf_mixtral, hf_phi,
        hf_gemma, hf_bert, hf_roberta, hf_distilbert, hf_albert, hf_electra, hf_deberta_v2,
        hf_bigbird, hf_longformer, hf_t5, hf_bart, hf_whisper, hf_vit, hf_swin, hf_convnext,
        hf_clip,
    )
}
