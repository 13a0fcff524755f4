package e2e

import (
	"embed"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"testing"
)

// sources are this package's Go files, built into the test binary: the
// guest runs e2e.test without them beside it.
//
//go:embed *.go
var sources embed.FS

// skipHelpers are the only functions that may end a test as skipped:
// skipOrFail (a missing tool: a failure under RBLK_E2E_REQUIRE=1) and
// notApplicable (a combination the test has no subject on, with its
// reason, listed by TestMain).
var skipHelpers = map[string]bool{"skipOrFail": true, "notApplicable": true}

// TestNoSilentSkip: no test of the suite skips but through skipOrFail or
// notApplicable. A direct t.Skip, t.Skipf or t.SkipNow would pass
// silently under RBLK_E2E_REQUIRE=1 on the build machine (the guest's
// verdict catches it, the bare run would not): it fails here, naming
// where, whether or not it would run.
func TestNoSilentSkip(t *testing.T) {
	t.Parallel()
	files, err := fs.Glob(sources, "*.go")
	if err != nil || len(files) == 0 {
		t.Fatalf("the embedded sources: %v (%d files)", err, len(files))
	}
	fset := token.NewFileSet()
	calls := 0
	for _, name := range files {
		src, err := sources.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		f, err := parser.ParseFile(fset, name, src, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Body == nil {
				continue
			}
			ast.Inspect(fn.Body, func(n ast.Node) bool {
				call, ok := n.(*ast.CallExpr)
				if !ok {
					return true
				}
				sel, ok := call.Fun.(*ast.SelectorExpr)
				if !ok {
					return true
				}
				switch sel.Sel.Name {
				case "Skip", "Skipf", "SkipNow":
					calls++
					if !skipHelpers[fn.Name.Name] {
						t.Errorf("%s: %s.%s in %s: a test skips through skipOrFail (a missing tool) or notApplicable (its reason), never directly",
							fset.Position(call.Pos()), exprString(sel.X), sel.Sel.Name, fn.Name.Name)
					}
				}
				return true
			})
		}
	}
	if calls < len(skipHelpers) {
		t.Fatalf("found %d skips in %d files, want at least those of %v: the scan is broken", calls, len(files), skipHelpers)
	}
}

// exprString names a receiver for the message: t, tb, s.t, ...
func exprString(e ast.Expr) string {
	switch e := e.(type) {
	case *ast.Ident:
		return e.Name
	case *ast.SelectorExpr:
		return exprString(e.X) + "." + e.Sel.Name
	}
	return "?"
}
