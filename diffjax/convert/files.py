"""Reading and writing a Hugging Face checkpoint directory with safetensors' numpy API.

No torch: tensors are numpy arrays (bfloat16 through ``ml_dtypes``). The directory's files:
docs/hf_conversion.md#what-the-mapping-does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can read BF16)
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# The safetensors dtypes of the weights diffjax imports (NumPy holds BF16 through ml_dtypes).
READABLE_DTYPES = ("F32", "BF16", "F16", "F64")
# transformers tags the files it writes with this metadata; its loader checks the tag.
FILE_METADATA = {"format": "pt"}


class ConversionError(ValueError):
  """A checkpoint or model that cannot be converted exactly; the message names what and why."""


def read_config(directory: str) -> dict[str, Any]:
  """The parsed ``config.json`` of a checkpoint directory."""
  if not os.path.isdir(directory):
    raise ConversionError(
      f"{directory!r} is not a directory: pass a local Hugging Face "
      "checkpoint directory holding config.json and *.safetensors."
    )
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(path):
    raise ConversionError(
      f"{directory!r} has no {CONFIG_FILE}: pass the directory that save_pretrained wrote."
    )
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ConversionError(f"{path!r} is not valid JSON ({e}).") from e
  if not isinstance(config, dict):
    raise ConversionError(f"{path!r} holds a {type(config).__name__}, not a JSON object.")
  return config


def _tensor_files(directory: str) -> dict[str, str]:
  """Tensor name -> safetensors file path, from the index or the single file."""
  index_path = os.path.join(directory, INDEX_FILE)
  if os.path.isfile(index_path):
    try:
      with open(index_path, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
      raise ConversionError(
        f"{index_path!r} is not a safetensors index with a weight_map ({type(e).__name__}: {e})."
      ) from e
    _check_weight_map(index_path, weight_map)
    files = {name: os.path.join(directory, fname) for name, fname in weight_map.items()}
    for path in sorted(set(files.values())):
      if not os.path.isfile(path):
        raise ConversionError(
          f"{index_path!r} lists {os.path.basename(path)!r}, which is not "
          f"in {directory!r}: copy every shard of the checkpoint."
        )
    return files
  single = os.path.join(directory, SINGLE_FILE)
  if not os.path.isfile(single):
    others = sorted(f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth")))
    hint = (
      f" It holds {others[0]!r}: save the model again with safetensors "
      "(save_pretrained does by default)."
      if others
      else ""
    )
    raise ConversionError(f"{directory!r} has neither {SINGLE_FILE} nor {INDEX_FILE}.{hint}")
  return {name: single for name in _file_keys(single)}


def _check_weight_map(index_path: str, weight_map: Any) -> None:
  """Refuses a ``weight_map`` that is not an object of tensor names to file names."""
  if not isinstance(weight_map, dict):
    raise ConversionError(
      f"{index_path!r}: weight_map is a {type(weight_map).__name__}, not an object of tensor "
      "names to file names."
    )
  for name, fname in weight_map.items():
    if not isinstance(fname, str) or not fname:
      raise ConversionError(f"{index_path!r}: weight_map[{name!r}] = {fname!r} is not a file name.")


def _file_keys(path: str) -> list[str]:
  try:
    with safe_open(path, framework="np") as f:
      return list(f.keys())
  except (SafetensorError, OSError) as e:
    raise ConversionError(f"{path!r} is not a readable safetensors file ({e}).") from e


def read_tensors(directory: str) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint, by name, as numpy arrays in their stored dtype."""
  files = _tensor_files(directory)
  by_file: dict[str, list[str]] = {}
  for name, path in files.items():
    by_file.setdefault(path, []).append(name)
  tensors = {}
  for path, names in sorted(by_file.items()):
    try:
      with safe_open(path, framework="np") as f:
        present = set(f.keys())
        for name in names:
          if name not in present:
            raise ConversionError(
              f"The index says {name!r} is in {os.path.basename(path)!r}, "
              "but that file does not hold it."
            )
          tensors[name] = _get_tensor(f, name, path)
    except (SafetensorError, OSError) as e:
      raise ConversionError(f"{path!r} is not a readable safetensors file ({e}).") from e
  return tensors


def _get_tensor(f: Any, name: str, path: str) -> np.ndarray:
  """Tensor ``name`` of the open file ``f``; a dtype NumPy cannot hold (FP8, ...) is refused."""
  try:
    return f.get_tensor(name)
  except (AttributeError, TypeError, ValueError) as e:
    try:
      dtype = f.get_slice(name).get_dtype()
    except (AttributeError, SafetensorError):
      dtype = "unknown"
    raise ConversionError(
      f"Tensor {name!r} in {os.path.basename(path)!r} has dtype {dtype}, which diffjax cannot "
      f"import: it reads float weights stored as {', '.join(READABLE_DTYPES)}."
    ) from e


def parse_size(size: int | str) -> int:
  """Bytes from an int or a string like ``"5GB"``, ``"500MB"``, ``"40KB"`` (powers of 1000)."""
  if isinstance(size, int):
    return size
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", str(size).upper())
  if not m:
    raise ConversionError(f"max_shard_size={size!r} is not a size such as '5GB' or '500MB'.")
  scale = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9}
  return int(float(m.group(1)) * scale[m.group(2)])


def _shards(tensors: Mapping[str, np.ndarray], max_bytes: int) -> list[list[str]]:
  """Names grouped into files of at most ``max_bytes`` (a larger tensor gets a file alone)."""
  shards: list[list[str]] = [[]]
  size = 0
  for name in sorted(tensors):
    nbytes = tensors[name].nbytes
    if shards[-1] and size + nbytes > max_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += nbytes
  return shards


def write_checkpoint(
  directory: str,
  config: Mapping[str, Any],
  tensors: Mapping[str, np.ndarray],
  *,
  max_shard_size: int | str = "5GB",
  extra: Callable[[str], list[str]] | None = None,
) -> list[str]:
  """Writes ``config.json`` and the tensors (sharded past ``max_shard_size``) into ``directory``.

  ``directory`` must not exist or be empty; everything is written into a temporary sibling
  and renamed at the end, so a failure leaves no partial checkpoint. ``extra(tmp)`` writes
  further files (the tokenizer's) into that sibling and returns their names. Returns the file
  names.
  """
  max_bytes = parse_size(max_shard_size)
  if os.path.islink(directory):  # written where the link points, which it then names
    directory = os.path.realpath(directory)
  if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
    raise ConversionError(
      f"{directory!r} already exists and is not an empty directory: choose a new output directory."
    )
  parent = os.path.dirname(os.path.abspath(directory))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
  try:
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the checkpoint is an ordinary directory
    shards = _shards(tensors, max_bytes)
    names = []
    if len(shards) == 1:
      save_file(
        {k: np.ascontiguousarray(tensors[k]) for k in shards[0]},
        os.path.join(tmp, SINGLE_FILE),
        metadata=FILE_METADATA,
      )
      names.append(SINGLE_FILE)
    else:
      weight_map = {}
      for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(
          {k: np.ascontiguousarray(tensors[k]) for k in shard},
          os.path.join(tmp, fname),
          metadata=FILE_METADATA,
        )
        weight_map.update({k: fname for k in shard})
        names.append(fname)
      index = {
        "metadata": {
          "total_parameters": int(sum(t.size for t in tensors.values())),
          "total_size": int(sum(t.nbytes for t in tensors.values())),
        },
        "weight_map": dict(sorted(weight_map.items())),
      }
      write_json_file(os.path.join(tmp, INDEX_FILE), index)
      names.append(INDEX_FILE)
    write_json_file(os.path.join(tmp, CONFIG_FILE), config)
    names.append(CONFIG_FILE)
    if extra is not None:
      names.extend(extra(tmp))
    if os.path.isdir(directory):
      os.rmdir(directory)  # empty, checked above
    os.replace(tmp, directory)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return sorted(names)


def write_json_file(path: str, obj: Any) -> None:
  """A JSON file of a checkpoint directory, as transformers writes them (sorted keys, indent 2)."""
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
    f.write("\n")
