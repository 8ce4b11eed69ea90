"""Pages people read after a run (layer 6, above `kit.show`): `html` the pieces every page is
built of, `report` a run folder as one page and two runs side by side, `sweep_page` a sweep's
page. They read run folders; they run nothing."""
