"""The tiny CPU demo: the `hypersloth-init` default template (no GPU, no internet needed); `make demo` trains it.

Its settings are the template itself, HyperSloth/templates/tiny_cpu.py, where each one is commented;
`hypersloth-init my_config.py` writes that file for you to edit. Imported, not copied: the demo trains
exactly what `hypersloth-init` writes, into its own output_dir (outputs/tiny-demo; the template's is
outputs/tiny-cpu).

Before training, build the two local inputs it names:
    hypersloth-tiny-model                                 # random-weight tiny Qwen3 -> build/tiny-qwen3
    hypersloth-build-dataset --local_path data/sample_chat.jsonl --name sample-chat \
        --tokenizer build/tiny-qwen3 --max_seq_length 1024   # registers 'sample-chat' in data/
Then:
    hypersloth-plan examples/tiny_cpu_demo.py             # show the batch plan, no training
    hypersloth-train examples/tiny_cpu_demo.py

Global batch = per_device_train_batch_size x gradient_accumulation_steps x len(gpus)
             = 4 x 2 x 2 = 16 samples per optimizer step.
"""

from HyperSloth.templates.tiny_cpu import hyper_config_model, training_config_model as template_args  # noqa: F401

# The demo's own folder: a config written by `hypersloth-init` (outputs/tiny-cpu) never meets the demo's run.
training_config_model = template_args.model_copy(update={"output_dir": "outputs/tiny-demo"})
