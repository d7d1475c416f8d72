"""``bench/harness.py``'s :class:`BenchRun` and ``bench/e2e_models.py``'s configs on the CPU: what end-to-end
runs open with."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from harness import BenchRun  # noqa: E402


def test_results_record_the_backends_environment(tmp_path, monkeypatch):
    for name in [k for k in os.environ if k.startswith("NVFP4_SPARSE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("NVFP4_SPARSE_PREDECODE", "off")
    monkeypatch.setenv("NVFP4_SPARSE_TOPK", "32")
    monkeypatch.setenv("UNRELATED_SETTING", "1")
    bench = BenchRun(str(tmp_path), "e2e.json", 60)
    bench.save()
    saved = json.loads((tmp_path / "e2e.json").read_text())
    assert saved["env"] == {"NVFP4_SPARSE_PREDECODE": "off", "NVFP4_SPARSE_TOPK": "32"}
    assert saved["budget_s"] == 60 and saved["argv"] == sys.argv


def test_a_dense_models_mlp_width_reaches_config_and_weights(tmp_path):
    from safetensors import safe_open

    from sglang_nvfp4.tiny_model import make_tiny_model

    folder = make_tiny_model(str(tmp_path / "m"), kv_heads=1, layers=1, hidden_size=256, intermediate_size=96)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["intermediate_size"] == 96
    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    with safe_open(os.path.join(folder, files[0]), "pt") as weights:
        assert tuple(weights.get_tensor("model.layers.0.mlp.up_proj.weight").shape) == (96, 256)


def test_the_tp4_rank_model_is_shaped_as_one_rank_of_a_64_by_4_moe_model(tmp_path):
    import e2e_models

    config = json.loads(open(os.path.join(e2e_models.dummy_model(str(tmp_path), "gqa16x1", 4096),
                                          "config.json")).read())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (16, 1, 128)
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (4096, 3072, 4)
    assert e2e_models.model_record("gqa16x1", 4096)["intermediate_size"] == 3072
