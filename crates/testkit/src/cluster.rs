//! Where a controller scenario runs: the in-process fake API server (`fake_api.rs`), or a real
//! cluster (`E2E=1` and `KUBECONFIG` set) in a fresh namespace with the CRD applied. Without them
//! an `e2e::*` case says SKIPPED, unless `REQUIRE_KUBE=1` (CI, `.ci/run`, which starts a real
//! kube-apiserver with `../shared/kube/up`): then it fails.
//!
//! A scenario is written once against [`Cluster`]; only what a real server cannot answer differs
//! (`status_writes` is `None` there).

use std::ffi::OsString;
use std::io::Write as _;
use std::path::Path;
use std::time::Duration;

use dlq_replay_api::DlqReplay;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{json, Value};

use crate::fake_api::FakeApi;

/// What an `e2e::*` test prints (to stderr) when it has no cluster to run against.
pub const SKIP: &str = "SKIPPED: E2E=1 and KUBECONFIG not set";
/// The field manager of what the tests apply to a real cluster.
const MANAGER: &str = "dlq-replay-tests";

enum Backend {
    Fake(FakeApi),
    Real(Client),
}

/// One test's cluster and namespace.
pub struct Cluster {
    backend: Backend,
    ns: String,
}

impl Cluster {
    /// A fresh in-process fake API server. Its namespace is fresh too (`replays-XXXXXX`): the
    /// engine keeps a replay's Redis state by namespace/name, so fixed names would meet the
    /// state of an earlier run.
    pub async fn fake() -> Cluster {
        Cluster {
            backend: Backend::Fake(FakeApi::start().await),
            ns: format!(
                "replays-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..6]
            ),
        }
    }

    /// A fresh namespace of the cluster `KUBECONFIG` points at, with `crds/dlqreplay.yaml`
    /// server-side applied and Established first; `None` (and a SKIPPED line on stderr) unless
    /// `E2E=1` and `KUBECONFIG` are set.
    pub async fn real(test: &str) -> Option<Cluster> {
        let (client, ns) = e2e_namespace(test, "dlq-ctl").await?;
        Some(Cluster {
            backend: Backend::Real(client),
            ns,
        })
    }

    /// Whether this is a real cluster.
    pub fn is_real(&self) -> bool {
        matches!(self.backend, Backend::Real(_))
    }

    /// A client of the cluster (on the fake a new one each call, with its own connections).
    pub fn client(&self) -> Client {
        match &self.backend {
            Backend::Fake(f) => f.client(),
            Backend::Real(c) => c.clone(),
        }
    }

    /// This test's namespace.
    pub fn ns(&self) -> &str {
        &self.ns
    }

    /// What an in-process operator should watch: everything on the fake (nobody else is there),
    /// only this test's namespace on a real cluster (other tests' replays live next door).
    pub fn watch_namespace(&self) -> Option<String> {
        match &self.backend {
            Backend::Fake(_) => None,
            Backend::Real(_) => Some(self.ns.clone()),
        }
    }

    /// Creates or replaces a Secret whose `data` holds these keys.
    pub async fn put_secret(&self, ns: &str, name: &str, data: &[(&str, &str)]) {
        match &self.backend {
            Backend::Fake(f) => f.put_secret(ns, name, data),
            Backend::Real(c) => {
                let secret = Secret {
                    metadata: ObjectMeta {
                        name: Some(name.into()),
                        namespace: Some(ns.into()),
                        ..ObjectMeta::default()
                    },
                    type_: Some("Opaque".into()),
                    data: Some(
                        data.iter()
                            .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                            .collect(),
                    ),
                    ..Secret::default()
                };
                Api::<Secret>::namespaced(c.clone(), ns)
                    .patch(
                        name,
                        &PatchParams::apply(MANAGER).force(),
                        &Patch::Apply(&secret),
                    )
                    .await
                    .unwrap_or_else(|e| panic!("apply Secret {ns}/{name}: {e}"));
            }
        }
    }

    /// The Events of a namespace as JSON (on a real cluster the events.k8s.io/v1 ones).
    pub async fn events(&self, ns: &str) -> Vec<Value> {
        match &self.backend {
            Backend::Fake(f) => f
                .events()
                .into_iter()
                .filter(|e| e["metadata"]["namespace"] == ns)
                .collect(),
            Backend::Real(c) => Api::<Event>::namespaced(c.clone(), ns)
                .list(&ListParams::default())
                .await
                .unwrap_or_else(|e| panic!("list events of {ns}: {e}"))
                .items
                .iter()
                .map(|e| serde_json::to_value(e).expect("event json"))
                .collect(),
        }
    }

    /// How many status writes hit `ns/name`; `None` on a real cluster, which does not count
    /// them (skip such assertions there).
    pub fn status_writes(&self, ns: &str, name: &str) -> Option<usize> {
        match &self.backend {
            Backend::Fake(f) => Some(f.status_writes(ns, name)),
            Backend::Real(_) => None,
        }
    }

    /// An object as JSON, by plural (`leases`, `dlqreplays`, `secrets`), namespace and name.
    pub async fn get_json(&self, plural: &str, ns: &str, name: &str) -> Option<Value> {
        let c = match &self.backend {
            Backend::Fake(f) => return f.get_json(plural, ns, name),
            Backend::Real(c) => c.clone(),
        };
        async fn get<K>(api: Api<K>, name: &str) -> Option<Value>
        where
            K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
            K: serde::Serialize,
        {
            let obj = api
                .get_opt(name)
                .await
                .unwrap_or_else(|e| panic!("get {name}: {e}"))?;
            Some(serde_json::to_value(&obj).expect("object json"))
        }
        match plural {
            "leases" => get(Api::<Lease>::namespaced(c, ns), name).await,
            // As stored (DynamicObject): the typed status would drop what dlq_replay_api does not
            // model, e.g. the conditions' observedGeneration.
            "dlqreplays" => {
                let ar = kube::api::ApiResource::erase::<DlqReplay>(&());
                get(
                    Api::<kube::api::DynamicObject>::namespaced_with(c, ns, &ar),
                    name,
                )
                .await
            }
            "secrets" => get(Api::<Secret>::namespaced(c, ns), name).await,
            other => panic!("get_json: {other} not supported on a real cluster"),
        }
    }

    /// The value of `KUBECONFIG` for a child process: on the fake a kubeconfig written to `dir`
    /// for its URL, on a real cluster this process's own.
    pub fn kubeconfig(&self, dir: &Path) -> OsString {
        match &self.backend {
            Backend::Fake(f) => {
                let path = dir.join("kubeconfig");
                std::fs::write(
                    &path,
                    format!(
                        "apiVersion: v1\nkind: Config\nclusters: [{{name: fake, cluster: {{server: \"{}\"}}}}]\nusers: [{{name: fake, user: {{}}}}]\ncontexts: [{{name: fake, context: {{cluster: fake, user: fake, namespace: default}}}}]\ncurrent-context: fake\n",
                        f.url()
                    ),
                )
                .expect("write kubeconfig");
                path.into_os_string()
            }
            Backend::Real(_) => std::env::var_os("KUBECONFIG").expect("KUBECONFIG"),
        }
    }

    /// Deletes the engine's Redis state of this namespace's replays (`dlq:*:NS/*`); on a real
    /// cluster also this test's replays and namespace ([`delete_namespace`]).
    pub async fn cleanup(&self) {
        self.forget_redis_state().await;
        if let Backend::Real(c) = &self.backend {
            delete_namespace(c, &self.ns).await;
        }
    }
}

/// Deletes a test's namespace of a real cluster, its replays first (dropping finalizers no
/// operator is left to remove): the cluster has no namespace controller, so a deleted namespace
/// keeps what it holds, and replays left there would meet later tests' cluster-wide lists.
pub async fn delete_namespace(client: &Client, ns: &str) {
    let api: Api<DlqReplay> = Api::namespaced(client.clone(), ns);
    // Deleting first marks them, so that a still-running operator cannot add a finalizer back.
    let _ = api
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    drop_finalizers(&api).await;
    let _ = Api::<Namespace>::all(client.clone())
        .delete(ns, &DeleteParams::default())
        .await;
}

/// Removes the finalizers of every replay `api` lists (no operator is left to remove them).
pub async fn drop_finalizers(api: &Api<DlqReplay>) {
    let Ok(list) = api.list(&ListParams::default()).await else {
        return;
    };
    for r in list {
        if !r.finalizers().is_empty() {
            let _ = api
                .patch(
                    &r.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                )
                .await;
        }
    }
}

impl Cluster {
    async fn forget_redis_state(&self) {
        let Ok(mut r) = dlq_replay_engine::store::connect(crate::world::redis_url()).await else {
            return;
        };
        crate::world::forget_keys(&mut r, &format!("dlq:*:{}/*", self.ns)).await;
    }
}

/// The client of the cluster `KUBECONFIG` points at and a fresh namespace `{prefix}-{test}-{hex}`
/// in it, with `crds/dlqreplay.yaml` applied and Established; `None` (and a SKIPPED line on
/// stderr) unless `E2E=1` and `KUBECONFIG` are set. With `REQUIRE_KUBE=1` their absence panics.
pub async fn e2e_namespace(test: &str, prefix: &str) -> Option<(Client, String)> {
    let e2e = std::env::var("E2E").is_ok_and(|v| v == "1");
    let kubeconfig = std::env::var("KUBECONFIG").is_ok_and(|v| !v.is_empty());
    if !(e2e && kubeconfig) {
        if std::env::var("REQUIRE_KUBE").as_deref() == Ok("1") {
            panic!(
                "e2e::{test}: E2E=1 and KUBECONFIG not set (REQUIRE_KUBE=1; .ci/run starts ../shared/kube/up and sets them)"
            );
        }
        // Straight to the process's stderr, past the test harness's capture.
        let _ = writeln!(std::io::stderr(), "e2e::{test}: {SKIP}");
        return None;
    }
    let client = Client::try_default()
        .await
        .expect("kube client from KUBECONFIG");
    apply_crd(&client).await;
    let ns = format!(
        "{prefix}-{}-{}",
        test.replace('_', "-")
            .chars()
            .take(40)
            .collect::<String>()
            .trim_end_matches('-'),
        &uuid::Uuid::new_v4().simple().to_string()[..6]
    );
    let namespace: Namespace =
        serde_json::from_value(json!({"metadata": {"name": ns}})).expect("namespace");
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("create test namespace");
    let _ = writeln!(
        std::io::stderr(),
        "e2e::{test}: running against the real cluster in namespace {ns}"
    );
    Some((client, ns))
}

/// Server-side applies `crds/dlqreplay.yaml` and waits (up to 60 s) until it is Established.
async fn apply_crd(client: &Client) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../crds/dlqreplay.yaml");
    let text = std::fs::read_to_string(path).expect("crds/dlqreplay.yaml");
    let crd: CustomResourceDefinition = serde_yaml::from_str(&text).expect("CRD yaml");
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    crds.patch(
        &crd.name_any(),
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&crd),
    )
    .await
    .expect("apply CRD");
    let end = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let established = crds.get(&crd.name_any()).await.ok().is_some_and(|c| {
            c.status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        });
        if established {
            return;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "CRD not Established within 60s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
