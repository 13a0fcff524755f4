package kubernetes

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// toolPackage is the Debian package of each tool rblk-csi's node service
// runs.
var toolPackage = map[string]string{
	"blkid":      "util-linux",
	"mkfs.ext4":  "e2fsprogs",
	"resize2fs":  "e2fsprogs",
	"mkfs.xfs":   "xfsprogs",
	"xfs_growfs": "xfsprogs",
	"mount":      "mount",
	"umount":     "mount",
	"mdadm":      "mdadm",
}

// toolCall finds the tools csidriver and mirror run by name: run(ctx,
// "NAME", ...), o.Run(ctx, "NAME", ...) and exec.CommandContext(ctx,
// "NAME", ...).
var toolCall = regexp.MustCompile(`(?:\brun\(|\.Run\(|exec\.CommandContext\()[a-zA-Z.()]+, "([a-z0-9._-]+)"`)

// TestDockerfile: deploy/Dockerfile builds rblk-csi and rblk-attach with
// the verbs provider, puts them on PATH (the DaemonSet's --attach-bin is
// rblk-attach), runs rblk-csi, and installs rdma-core's libraries and the
// package of every tool the node service runs (found in csidriver's
// sources, so that a new one cannot be left out).
func TestDockerfile(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	text := strings.ReplaceAll(string(b), "\\\n", " ")
	stages := regexp.MustCompile(`(?m)^FROM `).Split(text, -1)[1:] // (before the first: comments)
	if len(stages) != 2 {
		t.Fatalf("want a build stage and the image's, got %d stages", len(stages))
	}
	build, image := stages[0], stages[1]
	for _, want := range []string{"-tags rdma", "./cmd/rblk-csi", "./cmd/rblk-attach", "libibverbs-dev", "librdmacm-dev"} {
		if !strings.Contains(build, want) {
			t.Errorf("the build stage lacks %q", want)
		}
	}
	if !strings.Contains(image, "/usr/local/bin/") || !strings.Contains(image, `ENTRYPOINT ["/usr/local/bin/rblk-csi"]`) {
		t.Error("the image does not put the binaries in /usr/local/bin and run rblk-csi")
	}
	var installed []string
	for _, line := range strings.Split(image, "\n") {
		if _, rest, ok := strings.Cut(line, "apt-get install"); ok {
			rest, _, _ = strings.Cut(rest, "&&")
			installed = append(installed, strings.Fields(rest)...)
		}
	}
	for _, pkg := range []string{"libibverbs1", "librdmacm1", "ibverbs-providers"} {
		if !slices.Contains(installed, pkg) {
			t.Errorf("the image does not install %s", pkg)
		}
	}
	srcs, _ := filepath.Glob(filepath.Join("..", "..", "csidriver", "*.go"))
	mirrorSrcs, _ := filepath.Glob(filepath.Join("..", "..", "mirror", "*.go")) // (a mirror's node runs mdadm)
	srcs = append(srcs, mirrorSrcs...)
	tools := map[string]bool{}
	for _, src := range srcs {
		if strings.HasSuffix(src, "_test.go") {
			continue
		}
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range toolCall.FindAllStringSubmatch(string(b), -1) {
			tools[m[1]] = true
		}
	}
	if len(tools) < 5 {
		t.Fatalf("found only %v in csidriver's sources: the pattern no longer matches its calls", tools)
	}
	for tool := range tools {
		pkg, ok := toolPackage[tool]
		switch {
		case !ok:
			t.Errorf("csidriver runs %s: add its Debian package to toolPackage and to the Dockerfile", tool)
		case !slices.Contains(installed, pkg):
			t.Errorf("csidriver runs %s, but the image does not install %s", tool, pkg)
		}
	}
}
