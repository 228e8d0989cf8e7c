"""The transformers configs of the Transformer and DIFF V1 models exported by diffjax with their
own code (``model_type`` "diffjax_transformer" and "diffjax_v1").

Both are Llama's fields. For DIFF V1, ``num_attention_heads`` and ``num_key_value_heads`` count
component heads, as DiffLlama's config does: 2h query heads (the first h are the first query
components of the h DIFF heads, the next h the second) and 2k key heads (k1, then k2); the value
of kv group g is the pair of component value heads (g, k + g), 2d wide.
"""

from transformers import LlamaConfig


class DiffjaxTransformerConfig(LlamaConfig):
  """LlamaConfig under its own model type: a diffjax Transformer exported with its own code."""

  model_type = "diffjax_transformer"


class DiffjaxV1Config(LlamaConfig):
  """LlamaConfig for DIFF V1, with head counts of component heads (both even) and
  ``lambda_std_dev``, the spread of the lambda vectors at initialisation."""

  model_type = "diffjax_v1"
  # Llama's tensor-parallel plan splits heads one by one; a differential head is two of them
  # (and their value, lambda and norm), so these models run unsplit.
  base_model_tp_plan = None

  def __init__(self, lambda_std_dev: float = 0.1, **kwargs):
    heads = kwargs.get("num_attention_heads", 32)
    kv_heads = kwargs.get("num_key_value_heads", heads)
    if heads % 2 or (kv_heads or heads) % 2:
      raise ValueError(
        f"num_attention_heads={heads} and num_key_value_heads={kv_heads} must be even: DIFF V1 "
        "counts two component heads per head."
      )
    self.lambda_std_dev = lambda_std_dev
    super().__init__(**kwargs)
