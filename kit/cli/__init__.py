"""`python -m kit ...` (the top layer): `main` gathers the commands; `bench` (compile, decode),
`bench_vllm` and `suite` are the benchmarks, `new_checkpoint` writes a random-weight checkpoint
folder. The other commands come with the modules they drive (`run`, `report`, `sweep`)."""
