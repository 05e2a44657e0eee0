// Command gowebhook is the baseline of bench/webhook_vegeta.py: a plain Go net/http TLS
// mutating webhook doing what gpualloc's webhook does for the benchmark's request.
//
// It decodes the AdmissionReview, checks the request is a Pod CREATE carrying the
// gpu.scheduling/claim annotation, looks the claim up in memory (as gpualloc's watch cache
// does), refuses a pod that also asks the device plugin for nvidia.com/gpu or is pinned to
// another node, and answers with the same JSON Patch as gpualloc: the node selector, the two
// device variables in every container (a user's entry replaced in place, later containers
// copying the entries from the first one that got them), the devices annotation, the scheduling
// gate and the gated label (the controller lifts the gate), and a warning when a user-set
// variable was replaced. Only one-replica claims and UUIDs; no metrics.
//
// Two ways to decode, everything else shared:
//
//   - -decode=k8s (the default): as Go webhooks usually decode, the review into
//     k8s.io/api/admission/v1's AdmissionReview and its object into k8s.io/api/core/v1's
//     Pod (the peer gpu-scheduler's webhook does this; so does controller-runtime's decoder,
//     with the same typed structs);
//
//   - -decode=fields: encoding/json into small structs of only the fields the decision reads,
//     a trimmed decode few webhooks bother with.
//
//     gowebhook -cert tls.crt -key tls.key -addr 127.0.0.1:8443 -claims claims.json [-decode k8s|fields]
//
// claims.json: {"<namespace>/<name>": {"node": "...", "uuids": ["GPU-...", ...]}}.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"strings"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
)

const (
	claimAnnotation = "gpu.scheduling/claim"
	schedulingGate  = "gpu.scheduling/claim-allocated"
	gatedLabel      = "gpu.scheduling/gated"
)

type claim struct {
	Node  string   `json:"node"`
	UUIDs []string `json:"uuids"`
	// With DRA on: the replica's ResourceClaim, named in spec.resourceClaims as gpualloc-gpus
	// and in every container's resources.claims.
	ResourceClaim string `json:"resourceClaim,omitempty"`
}

const draPodClaim = "gpualloc-gpus"

type named struct {
	Name string `json:"name"`
}

type podClaim struct {
	Name              string `json:"name"`
	ResourceClaimName string `json:"resourceClaimName,omitempty"`
}

type envVar struct {
	Name      string          `json:"name"`
	Value     *string         `json:"value,omitempty"`
	ValueFrom json.RawMessage `json:"valueFrom,omitempty"`
}

type resources struct {
	Limits   map[string]json.RawMessage `json:"limits"`
	Requests map[string]json.RawMessage `json:"requests"`
	Claims   []named                    `json:"claims"`
}

type container struct {
	Name      string     `json:"name"`
	Env       []envVar   `json:"env"`
	Resources *resources `json:"resources"`
}

type gate struct {
	Name string `json:"name"`
}

type pod struct {
	Metadata struct {
		Name         string            `json:"name"`
		GenerateName string            `json:"generateName"`
		Namespace    string            `json:"namespace"`
		Annotations  map[string]string `json:"annotations"`
		Labels       map[string]string `json:"labels"`
	} `json:"metadata"`
	Spec struct {
		NodeName        string            `json:"nodeName"`
		NodeSelector    map[string]string `json:"nodeSelector"`
		InitContainers  []container       `json:"initContainers"`
		Containers      []container       `json:"containers"`
		SchedulingGates []gate            `json:"schedulingGates"`
		ResourceClaims  []podClaim        `json:"resourceClaims"`
	} `json:"spec"`
}

type request struct {
	UID  string `json:"uid"`
	Kind struct {
		Group string `json:"group"`
		Kind  string `json:"kind"`
	} `json:"kind"`
	Namespace   string `json:"namespace"`
	Operation   string `json:"operation"`
	SubResource string `json:"subResource"`
	Object      *pod   `json:"object"`
}

type review struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Request    *request `json:"request"`
}

type status struct {
	Code    int    `json:"code"`
	Reason  string `json:"reason"`
	Message string `json:"message"`
	Status  string `json:"status"`
}

type response struct {
	UID       string   `json:"uid"`
	Allowed   bool     `json:"allowed"`
	Status    *status  `json:"status,omitempty"`
	PatchType string   `json:"patchType,omitempty"`
	Patch     []byte   `json:"patch,omitempty"` // encoding/json writes []byte as base64
	Warnings  []string `json:"warnings,omitempty"`
}

type answer struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Response   response `json:"response"`
}

type op struct {
	Op    string `json:"op"`
	From  string `json:"from,omitempty"`
	Path  string `json:"path"`
	Value any    `json:"value,omitempty"`
}

type webhook struct {
	claims map[string]claim
	decode func(body []byte) (*review, error)
}

// decodeFields decodes only the fields the decision reads.
func decodeFields(body []byte) (*review, error) {
	var rv review
	if err := json.Unmarshal(body, &rv); err != nil {
		return nil, err
	}
	return &rv, nil
}

// decodeK8s decodes the way most Go webhooks do: the typed AdmissionReview, then the typed Pod.
func decodeK8s(body []byte) (*review, error) {
	var typed admissionv1.AdmissionReview
	if err := json.Unmarshal(body, &typed); err != nil {
		return nil, err
	}
	rv := &review{APIVersion: typed.APIVersion, Kind: typed.Kind}
	req := typed.Request
	if req == nil {
		return rv, nil
	}
	rv.Request = &request{UID: string(req.UID), Namespace: req.Namespace, Operation: string(req.Operation), SubResource: req.SubResource}
	rv.Request.Kind.Group, rv.Request.Kind.Kind = req.Kind.Group, req.Kind.Kind
	if len(req.Object.Raw) > 0 {
		var p corev1.Pod
		if err := json.Unmarshal(req.Object.Raw, &p); err != nil {
			return nil, err
		}
		rv.Request.Object = fromPod(&p)
	}
	return rv, nil
}

// fromPod copies what the decision reads out of a typed Pod.
func fromPod(p *corev1.Pod) *pod {
	out := &pod{}
	out.Metadata.Name, out.Metadata.GenerateName, out.Metadata.Namespace = p.Name, p.GenerateName, p.Namespace
	out.Metadata.Annotations, out.Metadata.Labels = p.Annotations, p.Labels
	for _, g := range p.Spec.SchedulingGates {
		out.Spec.SchedulingGates = append(out.Spec.SchedulingGates, gate{Name: g.Name})
	}
	out.Spec.NodeName, out.Spec.NodeSelector = p.Spec.NodeName, p.Spec.NodeSelector
	for _, c := range p.Spec.ResourceClaims {
		entry := podClaim{Name: c.Name}
		if c.ResourceClaimName != nil {
			entry.ResourceClaimName = *c.ResourceClaimName
		}
		out.Spec.ResourceClaims = append(out.Spec.ResourceClaims, entry)
	}
	out.Spec.InitContainers = fromContainers(p.Spec.InitContainers)
	out.Spec.Containers = fromContainers(p.Spec.Containers)
	return out
}

func fromContainers(list []corev1.Container) []container {
	if list == nil {
		return nil
	}
	out := make([]container, len(list))
	for i, c := range list {
		out[i].Name = c.Name
		if c.Env != nil {
			out[i].Env = make([]envVar, len(c.Env))
			for j, e := range c.Env {
				out[i].Env[j].Name = e.Name
				if e.ValueFrom != nil {
					out[i].Env[j].ValueFrom = json.RawMessage(`{}`)
				} else {
					value := e.Value
					out[i].Env[j].Value = &value
				}
			}
		}
		quantities := func(list corev1.ResourceList) map[string]json.RawMessage {
			m := make(map[string]json.RawMessage, len(list))
			for name, q := range list {
				m[string(name)] = json.RawMessage(`"` + q.String() + `"`)
			}
			return m
		}
		out[i].Resources = &resources{Limits: quantities(c.Resources.Limits), Requests: quantities(c.Resources.Requests)}
		for _, rc := range c.Resources.Claims {
			out[i].Resources.Claims = append(out[i].Resources.Claims, named{Name: rc.Name})
		}
	}
	return out
}

func requestsGPU(r *resources) bool {
	if r == nil {
		return false
	}
	for _, list := range []map[string]json.RawMessage{r.Limits, r.Requests} {
		if q, ok := list["nvidia.com/gpu"]; ok && string(q) != "0" && string(q) != `"0"` && string(q) != "null" {
			return true
		}
	}
	return false
}

func escape(key string) string {
	return strings.ReplaceAll(strings.ReplaceAll(key, "~", "~0"), "/", "~1")
}

// decide returns the response for a decoded review.
func (h *webhook) decide(rv *review) response {
	req := rv.Request
	allow := response{UID: req.UID, Allowed: true}
	if req.Kind.Group != "" || req.Kind.Kind != "Pod" || req.SubResource != "" || req.Operation != "CREATE" || req.Object == nil {
		return allow
	}
	p := req.Object
	name, ok := p.Metadata.Annotations[claimAnnotation]
	if !ok {
		return allow
	}
	deny := func(message string) response {
		return response{UID: req.UID, Status: &status{Code: 403, Reason: "Forbidden", Message: message, Status: "Failure"}}
	}
	namespace := req.Namespace
	if namespace == "" {
		namespace = p.Metadata.Namespace
	}
	c, ok := h.claims[namespace+"/"+name]
	if !ok {
		return deny(fmt.Sprintf("GpuClaim %s/%s does not exist", namespace, name))
	}
	for _, list := range [][]container{p.Spec.InitContainers, p.Spec.Containers} {
		for _, ct := range list {
			if requestsGPU(ct.Resources) {
				return deny("the pod also requests nvidia.com/gpu from the device plugin")
			}
		}
	}
	if p.Spec.NodeName != "" {
		return deny("the pod sets spec.nodeName, which cannot be combined with the scheduling gate")
	}
	if pinned := p.Spec.NodeSelector["kubernetes.io/hostname"]; pinned != "" && pinned != c.Node {
		return deny("the pod is pinned to another node by its nodeSelector")
	}

	uuids := strings.Join(c.UUIDs, ",")
	wanted := []envVar{{Name: "CUDA_VISIBLE_DEVICES", Value: &uuids}, {Name: "NVIDIA_VISIBLE_DEVICES", Value: &uuids}}
	var ops []op
	if p.Spec.NodeSelector == nil {
		ops = append(ops, op{Op: "add", Path: "/spec/nodeSelector", Value: map[string]string{"kubernetes.io/hostname": c.Node}})
	} else if p.Spec.NodeSelector["kubernetes.io/hostname"] != c.Node {
		ops = append(ops, op{Op: "add", Path: "/spec/nodeSelector/kubernetes.io~1hostname", Value: c.Node})
	}
	var replaced []string
	source := "" // the env list path where the first container's new entries are, and their index
	at := 0
	for _, group := range []struct {
		prefix string
		list   []container
	}{{"/spec/initContainers/", p.Spec.InitContainers}, {"/spec/containers/", p.Spec.Containers}} {
		for i, ct := range group.list {
			path := fmt.Sprintf("%s%d/env", group.prefix, i)
			if ct.Env == nil {
				ops = append(ops, op{Op: "add", Path: path, Value: wanted})
				if source == "" {
					source, at = path+"/", 0
				}
				continue
			}
			placed := map[string]bool{}
			var removals []int
			for j, e := range ct.Env {
				var want *envVar
				for k := range wanted {
					if wanted[k].Name == e.Name {
						want = &wanted[k]
					}
				}
				if want == nil {
					continue
				}
				if placed[e.Name] {
					removals = append(removals, j)
					continue
				}
				placed[e.Name] = true
				if e.Value == nil || *e.Value != *want.Value || len(e.ValueFrom) > 0 {
					replaced = append(replaced, ct.Name+"/"+e.Name)
					ops = append(ops, op{Op: "replace", Path: fmt.Sprintf("%s/%d", path, j), Value: *want})
				}
			}
			for k := len(removals) - 1; k >= 0; k-- {
				ops = append(ops, op{Op: "remove", Path: fmt.Sprintf("%s/%d", path, removals[k])})
			}
			if len(placed) > 0 {
				for _, w := range wanted {
					if !placed[w.Name] {
						ops = append(ops, op{Op: "add", Path: path + "/-", Value: w})
					}
				}
				continue
			}
			if source == "" {
				for _, w := range wanted {
					ops = append(ops, op{Op: "add", Path: path + "/-", Value: w})
				}
				source, at = path+"/", len(ct.Env)
				continue
			}
			for k := range wanted {
				ops = append(ops, op{Op: "copy", From: fmt.Sprintf("%s%d", source, at+k), Path: path + "/-"})
			}
		}
	}
	key := "/metadata/annotations/" + escape("gpu.scheduling/devices")
	if p.Metadata.Annotations["gpu.scheduling/devices"] != uuids {
		ops = append(ops, op{Op: "add", Path: key, Value: uuids})
	}
	gated := false
	for _, g := range p.Spec.SchedulingGates {
		gated = gated || g.Name == schedulingGate
	}
	if p.Spec.SchedulingGates == nil {
		ops = append(ops, op{Op: "add", Path: "/spec/schedulingGates", Value: []gate{{Name: schedulingGate}}})
	} else if !gated {
		ops = append(ops, op{Op: "add", Path: "/spec/schedulingGates/-", Value: gate{Name: schedulingGate}})
	}
	if p.Metadata.Labels == nil {
		ops = append(ops, op{Op: "add", Path: "/metadata/labels", Value: map[string]string{gatedLabel: "true"}})
	} else if p.Metadata.Labels[gatedLabel] != "true" {
		ops = append(ops, op{Op: "add", Path: "/metadata/labels/" + escape(gatedLabel), Value: "true"})
	}
	if c.ResourceClaim != "" {
		ops = draOps(p, c.ResourceClaim, ops)
	}
	patch, err := json.Marshal(ops)
	if err != nil {
		return deny("the patch could not be encoded: " + err.Error())
	}
	out := response{UID: req.UID, Allowed: true, PatchType: "JSONPatch", Patch: patch}
	if len(replaced) > 0 {
		out.Warnings = []string{fmt.Sprintf("gpualloc replaced %s with the devices of GpuClaim %s/%s",
			strings.Join(replaced, ", "), namespace, name)}
	}
	return out
}

// draOps gives the pod its replica's ResourceClaim: the entry gpualloc-gpus in spec.resourceClaims,
// and that name in every init container's and container's resources.claims.
func draOps(p *pod, resourceClaim string, ops []op) []op {
	has := false
	for _, c := range p.Spec.ResourceClaims {
		has = has || c.Name == draPodClaim
	}
	entry := podClaim{Name: draPodClaim, ResourceClaimName: resourceClaim}
	if p.Spec.ResourceClaims == nil {
		ops = append(ops, op{Op: "add", Path: "/spec/resourceClaims", Value: []podClaim{entry}})
	} else if !has {
		ops = append(ops, op{Op: "add", Path: "/spec/resourceClaims/-", Value: entry})
	}
	ref := named{Name: draPodClaim}
	for _, group := range []struct {
		prefix string
		list   []container
	}{{"/spec/initContainers/", p.Spec.InitContainers}, {"/spec/containers/", p.Spec.Containers}} {
		for i, ct := range group.list {
			path := fmt.Sprintf("%s%d/resources", group.prefix, i)
			switch {
			case ct.Resources == nil:
				ops = append(ops, op{Op: "add", Path: path, Value: map[string][]named{"claims": {ref}}})
			case ct.Resources.Claims == nil:
				ops = append(ops, op{Op: "add", Path: path + "/claims", Value: []named{ref}})
			default:
				listed := false
				for _, c := range ct.Resources.Claims {
					listed = listed || c.Name == draPodClaim
				}
				if !listed {
					ops = append(ops, op{Op: "add", Path: path + "/claims/-", Value: ref})
				}
			}
		}
	}
	return ops
}

func (h *webhook) mutate(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 3<<20))
	if err != nil {
		http.Error(w, err.Error(), http.StatusRequestEntityTooLarge)
		return
	}
	rv, err := h.decode(body)
	if err != nil || rv.Request == nil || rv.Request.UID == "" {
		http.Error(w, "not an AdmissionReview with a request uid", http.StatusBadRequest)
		return
	}
	out, err := json.Marshal(answer{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview", Response: h.decide(rv)})
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Write(out)
}

func main() {
	addr := flag.String("addr", "127.0.0.1:8443", "address to listen on")
	cert := flag.String("cert", "", "PEM serving certificate")
	key := flag.String("key", "", "PEM private key")
	claimsFile := flag.String("claims", "", "JSON file: {\"namespace/name\": {\"node\": ..., \"uuids\": [...]}}")
	decode := flag.String("decode", "k8s", "k8s: typed k8s.io/api structs; fields: only the fields it reads")
	flag.Parse()
	h := &webhook{claims: map[string]claim{}, decode: decodeK8s}
	switch *decode {
	case "k8s":
	case "fields":
		h.decode = decodeFields
	default:
		log.Fatalf("-decode: want k8s or fields, got %q", *decode)
	}
	if *claimsFile != "" {
		data, err := os.ReadFile(*claimsFile)
		if err != nil {
			log.Fatal(err)
		}
		if err := json.Unmarshal(data, &h.claims); err != nil {
			log.Fatal(err)
		}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /mutate", h.mutate)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("ok\n")) })
	log.Fatal(http.ListenAndServeTLS(*addr, *cert, *key, mux))
}
