"""``python -m sglang_nvfp4.bench_one_batch ARGS``: SGLang's ``sglang.benchmark.one_batch`` with the
plugin registered first (that CLI parses ``--attention-backend`` before SGLang loads plugins)."""

from .sglang.plugin import register_and_apply


def main() -> None:
    register_and_apply()
    from sglang.benchmark.one_batch import cli_main

    cli_main()


if __name__ == "__main__":
    main()
