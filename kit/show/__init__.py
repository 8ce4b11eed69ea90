"""What a learner looks at (layer 5, above `kit.studies`): tables (`tables`), figures (`plots`,
plotly) and interactive controls (`widgets`, ipywidgets). They format and draw results that the
studies measured; they measure nothing themselves."""
