"""Start-up resolution: a config resolved once into the run every entry point takes (`run`:
`resolve_run` -> `Run`), its `auto` and -1 sizes settled against the devices and the data by
dry runs of its planner. `attention` (`model.attention: auto` for the devices, and checked),
`capacity` (bucket sizes suggested from the data, route capacity), `tilesize` (tile
capacities, long variants), `sizing` (the config's sizes resolved; its capacities),
`resumed` (the sizes a resumed run keeps)."""
