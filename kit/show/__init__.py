"""What a learner looks at (layer 5, above `kit.studies`): tables (`tables`; chapter 02's:
`kv_cache_tables`), figures (`plots`, plotly; chapter 02's: `kv_cache_plots`) and interactive
controls (`widgets`, ipywidgets). They format and draw results that the
studies measured; they measure nothing themselves."""
