"""What a config compiles to on a mesh: the train step (`program`), its pipeline-parallel form
(`stages`), and generation's prefill and decode programs (`generate`)."""
