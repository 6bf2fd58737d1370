"""LoRA adapters, for inference and training alike: the layer, the adapter files, and the two run-spec fields that
apply an adapter to a run.

- `lora.py`          `add_lora` / `remove_lora` / `inject` through peft, `LoraLinear` (factors on the op table),
                     PEFT-format adapter files (`save_adapter`, `adapter_files`, `adapter_digest`)
- `adapter_file.py`  `read_adapter` (PEFT directory or Diffusers .safetensors, checked before any model loads),
                     `check_shapes`, `files_digest`, `config_from_json`
- `field.py`         the `RunSpec.adapters` provider (`adapter_entry`; apply = inject for the run, refuse changed
                     bytes), `attached`, `describe`
- `lora_scale.py`    the `RunSpec.lora_scale` provider: the adapter's delta scaled per block and per modality

May import: the foundations, `execution`, `model`, `run`, `schema`. Never `training` (training imports this).
"""
