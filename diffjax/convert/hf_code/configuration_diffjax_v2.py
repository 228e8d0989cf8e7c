"""The transformers config of a DIFF V2 model exported by diffjax (``model_type`` "diffjax_v2").

Llama's fields, with ``num_attention_heads`` counting DIFF V2's query heads 2h (h pairs, h
output heads), as transformers' attention functions and serving engines count them, plus the
two settings of the V2 write-up's ablations.
"""

from transformers import LlamaConfig


class DiffjaxV2Config(LlamaConfig):
  """LlamaConfig plus ``v2_pairing`` ("group": pair i is query heads 2i and 2i+1, which share a
  kv head; "across_groups": heads i and i+h) and ``v2_lambda`` ("sigmoid": lambda =
  sigmoid(x W_lambda); "identity": x W_lambda)."""

  model_type = "diffjax_v2"
  # Llama's tensor-parallel plan splits heads one by one; a differential head is two of them
  # (and their value, lambda and norm), so these models run unsplit.
  base_model_tp_plan = None

  def __init__(self, v2_pairing: str = "group", v2_lambda: str = "sigmoid", **kwargs):
    if v2_pairing not in ("group", "across_groups"):
      raise ValueError(f"v2_pairing={v2_pairing!r} is not 'group' or 'across_groups'.")
    if v2_lambda not in ("sigmoid", "identity"):
      raise ValueError(f"v2_lambda={v2_lambda!r} is not 'sigmoid' or 'identity'.")
    heads = kwargs.get("num_attention_heads", 32)
    if heads % 2:
      raise ValueError(
        f"num_attention_heads={heads} must be even: DIFF V2's query heads are pairs."
      )
    self.v2_pairing = v2_pairing
    self.v2_lambda = v2_lambda
    super().__init__(**kwargs)
