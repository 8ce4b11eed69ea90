"""The decoder's parts, one small module each; `kit.engine.model` assembles them per family."""
