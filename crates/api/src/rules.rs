//! The rules of the resource beyond its types: the immutable fields, the URL schemes, the CEL
//! rules, and the CRD they are written into.

use super::DlqReplay;

/// Spec fields that are fixed once a replay exists (everything but `suspend`): a replay is
/// reviewed as a whole, and changing what it replays mid-way would make its audit trail lie.
const IMMUTABLE_REQUIRED: [&str; 3] = ["broker", "source", "quarantine"];
const IMMUTABLE_OPTIONAL: [&str; 10] = [
    "target",
    "selector",
    "poison",
    "idempotency",
    "audit",
    "rate",
    "canary",
    "expect",
    "requireApproval",
    "dryRun",
];

/// The URL schemes of the broker.
pub const AMQP_SCHEMES: [&str; 2] = ["amqp", "amqps"];
/// The URL schemes of Redis.
pub const REDIS_SCHEMES: [&str; 6] = [
    "redis",
    "rediss",
    "redis+sentinel",
    "rediss+sentinel",
    "redis+cluster",
    "rediss+cluster",
];

/// One CEL rule of the CRD (an entry of `x-kubernetes-validations`).
///
/// [`rules`] is the one list of the checks a schema keyword cannot express (cross-field rules,
/// URLs, immutability). [`crd`] puts each on its schema node, so `kubectl apply` refuses a spec
/// that breaks one, and the command line (`manifest::validate_spec`) evaluates the same rules
/// from that same schema: they are written here only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// The schema node the rule sits on and `self` is bound to: `spec`, `spec.broker`, ...;
    /// `name[]` stands for each item of the list `name` (`spec.selector.payload[]`).
    pub at: &'static str,
    /// The CEL expression: true when the value is valid. A rule that reads `oldSelf` is a
    /// transition rule, evaluated only on updates.
    pub rule: String,
    /// The field an error names, relative to `at` (`.url`); `None`: `at` itself.
    pub field_path: Option<String>,
    /// What the error says about that field.
    pub message: String,
    /// The error's reason: `FieldValueForbidden` for the immutable fields; `None` means
    /// `FieldValueInvalid`.
    pub reason: Option<&'static str>,
}

impl Rule {
    fn new(at: &'static str, rule: &str, field_path: Option<&str>, message: &str) -> Self {
        Self {
            at,
            rule: rule.into(),
            field_path: field_path.map(str::to_string),
            message: message.into(),
            reason: None,
        }
    }

    /// The field an error of this rule names, e.g. `spec.broker.url` (`[*]` for a list item).
    pub fn field(&self) -> String {
        format!(
            "{}{}",
            self.at.replace("[]", "[*]"),
            self.field_path.as_deref().unwrap_or("")
        )
    }

    /// Whether the rule compares with the stored object (`oldSelf`): evaluated on updates only.
    pub fn is_transition(&self) -> bool {
        self.rule.contains("oldSelf")
    }
}

/// The rule a connection's inline `url` must pass, as a CEL expression on `self.url` (true when
/// `url` is absent), with its message. The URL names one endpoint or several, separated by
/// commas: whole URLs, or hosts (`host:port`, the last one may carry the `/vhost?query` every
/// host shares) following a URL. Each URL must be a URL (Kubernetes' `isURL`) with one of
/// `schemes`, a host, and a port up to 65535. The message never repeats the URL (it may hold a
/// password).
pub fn url_rule(schemes: &[&str]) -> (String, String) {
    let list = schemes
        .iter()
        .map(|s| format!("'{s}'"))
        .collect::<Vec<_>>()
        .join(", ");
    let u = "url(e)";
    let one_url = format!(
        "isURL(e) && {u}.getScheme() in [{list}] && {u}.getHostname() != '' && ({u}.getPort() == '' || int({u}.getPort()) <= 65535)"
    );
    // A host after the first URL: a name or IPv4 address, and a port up to 65535.
    let one_host = "e.matches('^[A-Za-z0-9._-]+(:([0-9]{1,4}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5]))?([/?].*)?$')";
    let rule = format!(
        "!has(self.url) || (self.url.split(',')[0].contains('://') && self.url.split(',').all(e, e.contains('://') ? ({one_url}) : {one_host}))"
    );
    let message = format!(
        "must be a URL with scheme {} and a host (port at most 65535), e.g. {}://user:pass@host:port/..., or several separated by commas (a clustered server's endpoints: whole URLs, or hosts after the first URL as in {}://user:pass@host1:port,host2:port/...)",
        schemes.join(" or "),
        schemes[0],
        schemes[0],
    );
    (rule, message)
}

/// Every CEL rule of the CRD. The bounds of single fields (at least 1, 5 to 1800, not empty, a
/// JSON pointer, ...) are schema keywords on the fields above (`#[schemars(...)]`); these are
/// the rest.
pub fn rules() -> Vec<Rule> {
    let mut rules = vec![
        Rule::new(
            "spec",
            "self.quarantine.queue != self.source.queue",
            Some(".quarantine.queue"),
            "must differ from spec.source.queue",
        ),
        Rule::new(
            "spec",
            "!has(self.canary) || !has(self.canary.requireDone) || !self.canary.requireDone || (has(self.idempotency) && (!has(self.idempotency.mode) || self.idempotency.mode == 'Check'))",
            Some(".canary.requireDone"),
            "needs spec.idempotency.mode: Check",
        ),
        // An empty stanza would approve every signature with no maximum: a reviewer reading it
        // could take it for a limit.
        Rule::new(
            "spec",
            "!has(self.expect) || (has(self.expect.signatures) && size(self.expect.signatures) > 0) || has(self.expect.maxReplayed) || has(self.expect.maxQuarantined)",
            Some(".expect"),
            "approves everything: list signatures, or set maxReplayed or maxQuarantined",
        ),
        // `in` is a CEL keyword: Kubernetes escapes the field's name to `__in__`.
        Rule::new(
            "spec.selector.payload[]",
            "has(self.equals) || has(self.__in__)",
            None,
            "needs `equals` or `in`",
        ),
    ];
    for (at, schemes) in [
        ("spec.broker", &AMQP_SCHEMES[..]),
        ("spec.idempotency.redis", &REDIS_SCHEMES),
        ("spec.audit.redis", &REDIS_SCHEMES),
    ] {
        rules.push(Rule::new(
            at,
            "has(self.url) != has(self.urlSecretRef)",
            None,
            "give exactly one of url and urlSecretRef",
        ));
        let (rule, message) = url_rule(schemes);
        rules.push(Rule {
            at,
            rule,
            field_path: Some(".url".into()),
            message,
            reason: None,
        });
    }
    let immutable = |field: &str, rule: String| {
        Rule {
        at: "spec",
        rule,
        field_path: Some(format!(".{field}")),
        message: "is immutable: the spec of a DlqReplay is fixed except spec.suspend; create a new replay instead".into(),
        reason: Some("FieldValueForbidden"),
    }
    };
    for f in IMMUTABLE_REQUIRED {
        rules.push(immutable(f, format!("self.{f} == oldSelf.{f}")));
    }
    for f in IMMUTABLE_OPTIONAL {
        rules.push(immutable(
            f,
            format!(
                "has(self.{f}) == has(oldSelf.{f}) && (!has(self.{f}) || self.{f} == oldSelf.{f})"
            ),
        ));
    }
    rules
}

/// The CRD: the schema the types derive (with the bounds of their fields), plus the CEL rules
/// of [`rules`] on their nodes.
pub fn crd(
) -> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::ValidationRule;
    use kube::CustomResourceExt;
    let mut crd = DlqReplay::crd();
    let rules = rules();
    for version in &mut crd.spec.versions {
        let Some(root) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        else {
            continue;
        };
        for r in &rules {
            let node = schema_node(root, r.at)
                .unwrap_or_else(|| panic!("api::rules(): no schema node {}", r.at));
            node.x_kubernetes_validations
                .get_or_insert_with(Vec::new)
                .push(ValidationRule {
                    rule: r.rule.clone(),
                    message: Some(r.message.clone()),
                    reason: r.reason.map(str::to_string),
                    field_path: r.field_path.clone(),
                    ..Default::default()
                });
        }
    }
    crd
}

/// The schema node at `at` (see [`Rule::at`]).
fn schema_node<'a>(
    root: &'a mut k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaProps,
    at: &str,
) -> Option<
    &'a mut k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaProps,
> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaPropsOrArray;
    at.split('.').try_fold(root, |node, segment| {
        let (name, each) = match segment.strip_suffix("[]") {
            Some(name) => (name, true),
            None => (segment, false),
        };
        let child = node.properties.as_mut()?.get_mut(name)?;
        if !each {
            return Some(child);
        }
        match child.items.as_mut()? {
            JSONSchemaPropsOrArray::Schema(item) => Some(&mut **item),
            JSONSchemaPropsOrArray::Schemas(_) => None,
        }
    })
}
