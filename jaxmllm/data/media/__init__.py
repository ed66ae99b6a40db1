"""Media decoding with bounded cost: images (`image`) and audio clips (`audio`)."""
