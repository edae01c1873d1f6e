// cdi-validate loads CDI spec files with the CDI reference library (tags.cncf.io/container-device-interface),
// the parser and validator container runtimes use, so a spec it accepts is one containerd and CRI-O accept.
//
// Usage: cdi-validate FILE...
//
// Each file is read with cdi.ReadSpec: strict YAML/JSON decoding (unknown fields are errors), the cdiVersion
// checked against the lowest version the spec's features need, the kind's vendor and class, annotations, and
// every device's name and container edits (env, device nodes, mounts, hooks). It prints "FILE: ok" per valid
// file and "FILE: <problem>" per invalid one, and exits 1 when any file is invalid (2 on usage errors).
package main

import (
	"fmt"
	"os"

	"tags.cncf.io/container-device-interface/pkg/cdi"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: cdi-validate FILE...")
		os.Exit(2)
	}
	failed := false
	for _, path := range os.Args[1:] {
		// The priority only orders specs inside a cache; one file at a time needs none.
		spec, err := cdi.ReadSpec(path, 0)
		if err != nil {
			fmt.Printf("%s: %v\n", path, err)
			failed = true
			continue
		}
		fmt.Printf("%s: ok (kind %s, cdiVersion %s, %d devices)\n", path, spec.Kind, spec.Version, len(spec.Devices))
	}
	if failed {
		os.Exit(1)
	}
}
