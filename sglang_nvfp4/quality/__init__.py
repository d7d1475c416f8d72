"""Quality harness: a small retrieval model trained here, served by SGLang dense and with ``nvfp4_sparse``.

* :mod:`.task`: the key-value retrieval task (documents, evaluation prompts, tokenizer).
* :mod:`.model`: the decoder in plain PyTorch, computing what SGLang's ``GraniteForCausalLM`` computes.
* :mod:`.train`: ``python -m sglang_nvfp4.quality.train --out DIR`` (GPU or CPU).
* :mod:`.evaluate`: ``python -m sglang_nvfp4.quality.evaluate --model DIR --out OUT`` (real SGLang servers).
* :mod:`.stats`: Wilson and paired-difference intervals of the evaluation's accuracies.
* :mod:`.block_mass`: true attention mass per block and oracle selections, the yardstick of indexers.

``tests/test_quality_gate.py`` is the CI regression gate built on these.
"""
