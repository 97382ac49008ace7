"""Serving benchmark (Poisson arrivals, streaming; TTFT, TPOT, ITL, E2EL, throughput) against a
running `jlight serve` or any OpenAI-compatible server. The code lives in jlight.serve.bench_cli
so that `jlight bench serve` runs the same thing; see its docstring for the options.

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --request-rates 1,4,inf --out serving
"""
from jlight.serve.bench_cli import main

if __name__ == "__main__":
    main()
