package kubernetes

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/rblk/rblk/csidriver"
)

// object is a manifest's object, as a tree.
type object map[string]any

func (o object) str(path ...string) string {
	s, _ := o.get(path...).(string)
	return s
}

func (o object) get(path ...string) any {
	var cur any = map[string]any(o)
	for _, p := range path {
		m, ok := cur.(map[string]any)
		if !ok {
			return nil
		}
		cur = m[p]
	}
	return cur
}

func list(v any) []map[string]any {
	var out []map[string]any
	l, _ := v.([]any)
	for _, x := range l {
		if m, ok := x.(map[string]any); ok {
			out = append(out, m)
		}
	}
	return out
}

func strs(v any) []string {
	var out []string
	l, _ := v.([]any)
	for _, x := range l {
		s, _ := x.(string)
		out = append(out, s)
	}
	return out
}

// load reads every object of every manifest.
func load(t *testing.T) []object {
	t.Helper()
	files, err := filepath.Glob("*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests: %v", err)
	}
	var out []object
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		dec := yaml.NewDecoder(bytes.NewReader(b))
		for {
			var o map[string]any
			if err := dec.Decode(&o); errors.Is(err, io.EOF) {
				break
			} else if err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			if o == nil {
				continue
			}
			obj := object(o)
			if obj.str("apiVersion") == "" || obj.str("kind") == "" || obj.str("metadata", "name") == "" {
				t.Errorf("%s: an object without apiVersion, kind or metadata.name: %v", f, o)
			}
			out = append(out, obj)
		}
	}
	return out
}

func find(objs []object, kind, name string) object {
	for _, o := range objs {
		if o.str("kind") == kind && o.str("metadata", "name") == name {
			return o
		}
	}
	return nil
}

// TestManifests checks that the manifests agree with each other and with
// the driver.
func TestManifests(t *testing.T) {
	objs := load(t)
	if d := find(objs, "CSIDriver", csidriver.DriverName); d == nil {
		t.Errorf("no CSIDriver named %s", csidriver.DriverName)
	} else if d.get("spec", "attachRequired") != true {
		t.Error("the CSIDriver does not require attach: ControllerPublish (and the fence of ControllerUnpublish) would never run")
	}
	for _, o := range objs {
		ns := o.str("metadata", "namespace")
		if ns != "" && find(objs, "Namespace", ns) == nil {
			t.Errorf("%s %s: namespace %q is not in the manifests", o.str("kind"), o.str("metadata", "name"), ns)
		}
		switch o.str("kind") {
		case "StorageClass":
			if p := o.str("provisioner"); p != csidriver.DriverName {
				t.Errorf("StorageClass %s: provisioner %q, want %s", o.str("metadata", "name"), p, csidriver.DriverName)
			}
			params, _ := o.get("parameters").(map[string]any)
			strs := map[string]string{}
			for k, v := range params {
				s, ok := v.(string)
				if !ok {
					t.Errorf("StorageClass %s: parameter %q is %T: Kubernetes takes strings (quote it)", o.str("metadata", "name"), k, v)
				}
				strs[k] = s
			}
			if err := csidriver.CheckParameters(strs); err != nil {
				t.Errorf("StorageClass %s: rblk-csi refuses its parameters: %v", o.str("metadata", "name"), err)
			}
		case "ClusterRoleBinding", "RoleBinding":
			ref := o.get("roleRef").(map[string]any)
			if find(objs, ref["kind"].(string), ref["name"].(string)) == nil {
				t.Errorf("%s %s: no %s %s", o.str("kind"), o.str("metadata", "name"), ref["kind"], ref["name"])
			}
			for _, s := range list(o.get("subjects")) {
				if find(objs, "ServiceAccount", s["name"].(string)) == nil {
					t.Errorf("%s %s: no ServiceAccount %s", o.str("kind"), o.str("metadata", "name"), s["name"])
				}
			}
		case "Deployment", "DaemonSet":
			checkPod(t, objs, o)
		}
	}
}

// checkPod checks a workload: its service account, its volumes, the CSI
// socket every container shares, and rblk-csi's arguments.
func checkPod(t *testing.T, objs []object, o object) {
	name := o.str("kind") + " " + o.str("metadata", "name")
	spec := object(o.get("spec", "template", "spec").(map[string]any))
	if sa := spec.str("serviceAccountName"); find(objs, "ServiceAccount", sa) == nil {
		t.Errorf("%s: no ServiceAccount %q", name, sa)
	}
	volumes := map[string]map[string]any{}
	for _, v := range list(spec.get("volumes")) {
		volumes[v["name"].(string)] = v
	}
	socketDir := ""
	for _, c := range list(spec.get("containers")) {
		cname := c["name"].(string)
		mounts := map[string]string{}
		for _, m := range list(c["volumeMounts"]) {
			vn := m["name"].(string)
			if volumes[vn] == nil {
				t.Errorf("%s: container %s mounts volume %q, which the pod does not have", name, cname, vn)
			}
			mounts[m["mountPath"].(string)] = vn
		}
		args := strs(c["args"])
		for _, a := range args {
			if addr, ok := strings.CutPrefix(a, "--csi-address="); ok {
				if vn := mounts[filepath.Dir(addr)]; vn == "" {
					t.Errorf("%s: container %s's CSI socket %s is on no volume it mounts", name, cname, addr)
				} else if socketDir == "" {
					socketDir = vn
				} else if vn != socketDir {
					t.Errorf("%s: container %s's CSI socket is on volume %s, the others' on %s", name, cname, vn, socketDir)
				}
			}
			if path, ok := strings.CutPrefix(a, "--kubelet-registration-path="); ok {
				want := "/var/lib/kubelet/plugins/" + csidriver.DriverName + "/csi.sock"
				if path != want {
					t.Errorf("%s: registration path %s, want %s", name, path, want)
				}
				hp, _ := volumes[socketDir]["hostPath"].(map[string]any)
				if hp == nil || hp["path"] != filepath.Dir(want) {
					t.Errorf("%s: the socket's volume %s is not the host's %s", name, socketDir, filepath.Dir(want))
				}
			}
		}
		if strings.Contains(c["image"].(string), "rblk-csi") {
			i := slices.IndexFunc(args, func(a string) bool { return strings.HasPrefix(a, "--endpoint=unix://") })
			if i < 0 {
				t.Errorf("%s: rblk-csi without --endpoint=unix://...", name)
				continue
			}
			if vn := mounts[filepath.Dir(strings.TrimPrefix(args[i], "--endpoint=unix://"))]; vn == "" {
				t.Errorf("%s: rblk-csi's socket is on no volume it mounts", name)
			}
			rblkCSIAccepts(t, name, args)
		}
	}
}

var (
	buildOnce sync.Once
	builtBin  string // in a temporary folder TestMain removes
	buildErr  error
)

// TestMain removes the rblk-csi built for the tests once they all ran (a
// test's cleanup removed it before the next run of -count).
func TestMain(m *testing.M) {
	code := m.Run()
	if builtBin != "" {
		os.RemoveAll(filepath.Dir(builtBin))
	}
	os.Exit(code)
}

// rblkCSIAccepts runs rblk-csi ARGS --help: cobra refuses an unknown flag
// or a bad value before it prints the help.
func rblkCSIAccepts(t *testing.T, name string, args []string) {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "rblk-csi-manifests")
		if err != nil {
			buildErr = err
			return
		}
		builtBin = filepath.Join(dir, "rblk-csi")
		if out, err := exec.Command("go", "build", "-o", builtBin, "../../cmd/rblk-csi").CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("build rblk-csi: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	bin := builtBin
	for i, a := range args {
		args[i] = strings.ReplaceAll(a, "$(RBLK_ZONE)", "zone-a") // (the kubelet expands it)
	}
	out, err := exec.Command(bin, append(slices.Clone(args), "--help")...).CombinedOutput()
	if err != nil {
		t.Errorf("%s: rblk-csi refuses its arguments %q: %v\n%s", name, args, err, out)
	}
}
