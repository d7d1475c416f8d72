"""``python -m sglang_nvfp4.bench_offline_throughput ARGS``: SGLang's
``sglang.benchmark.offline_throughput`` with the plugin registered first (that CLI parses
``--attention-backend`` before SGLang loads plugins)."""

from .sglang.plugin import register_and_apply


def main() -> None:
    register_and_apply()
    from sglang.benchmark.offline_throughput import cli_main

    cli_main()


if __name__ == "__main__":
    main()
